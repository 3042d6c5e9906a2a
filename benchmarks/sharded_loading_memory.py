"""Peak host memory of loading one tensor-parallel rank's weights from an HF checkpoint: the whole state
dict (``load_file`` + ``hf_to_megatron``, what every rank used to do) versus the lazy sharded reader
(``sharded_loading``: ``safe_open(...).get_slice`` of the rank's chunk, parameter by parameter).

    .venv/bin/python benchmarks/sharded_loading_memory.py [--tp 2 --json OUT] [--quick]

Checkpoints: the tiny default (hidden 128) and a hidden-1024 MiMo-architecture one built by
``skyrl_mtp.models.tiny`` (8 layers, ~140M parameters, ~0.55 GB fp32); --quick uses the tiny one only.
Each (checkpoint, mode) runs in its own process; the peak is Linux VmHWM after the load, the delta is
that peak minus the resident memory just before it (imports done). Both modes end holding the rank's
shard (what the model's parameters hold), so the delta is the cost of loading including the result.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPECS = {"tiny": {}, "hidden1024": dict(hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=4096)}


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _child(mode: str, ckpt: str, tp: int, rank: int) -> dict:
    import torch

    from skyrl_mtp.policy.megatron.hf_bridge import hf_to_megatron
    from skyrl_mtp.policy.megatron.model_builder import model_args_from_checkpoint
    from skyrl_mtp.policy.megatron.sharded_loading import LazyHFCheckpoint, check_checkpoint, iter_tp_shard
    from skyrl_mtp.policy.megatron_policy import load_hf_weights

    args = model_args_from_checkpoint(ckpt)
    mtp = args.num_nextn_predict_layers
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _kib("VmRSS")
    t0 = time.perf_counter()
    if mode == "whole_state_dict":
        shard = hf_to_megatron(load_hf_weights(ckpt), args, mtp, tp_rank=rank, tp_size=tp)
    else:
        lazy = LazyHFCheckpoint(ckpt)
        shard = dict(iter_tp_shard(lazy, check_checkpoint(lazy, args, mtp), tp_rank=rank, tp_size=tp))
    seconds = time.perf_counter() - t0
    peak = _kib("VmHWM")
    numel = sum(t.numel() for t in shard.values())
    assert all(isinstance(t, torch.Tensor) for t in shard.values())
    return {"peak_rss_mb": peak / 1024, "delta_rss_mb": (peak - base) / 1024, "load_s": seconds,
            "shard_mb": numel * 4 / 2**20}


def _checkpoint(name: str, root: Path) -> Path:
    from skyrl_mtp.models.tiny import TinyModelSpec, build_tiny_checkpoint

    out = root / name
    if not (out / "config.json").exists():
        build_tiny_checkpoint(out, TinyModelSpec(seed=0, **SPECS[name]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rank", type=int, default=0, help="the TP rank whose shard is loaded")
    ap.add_argument("--quick", action="store_true", help="tiny checkpoint only")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "CKPT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child[0], a.child[1], a.tp, a.rank)))
        return 0
    rows = []
    names = ["tiny"] if a.quick else list(SPECS)
    with tempfile.TemporaryDirectory(prefix="shard_mem_") as tmp:
        for name in names:
            ckpt = _checkpoint(name, Path(tmp))
            size_mb = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 2**20
            for mode in ("whole_state_dict", "sharded"):
                proc = subprocess.run([sys.executable, __file__, "--tp", str(a.tp), "--rank", str(a.rank),
                                       "--child", mode, str(ckpt)], capture_output=True, text=True, check=True)
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                rows.append({"checkpoint": name, "checkpoint_mb": size_mb, "tp": a.tp, "mode": mode, **r})
    print(f"{'checkpoint':<11} {'file MB':>8} {'tp':>3} {'mode':<17} {'shard MB':>9} {'peak RSS MB':>12} "
          f"{'delta MB':>9} {'load s':>7}")
    for r in rows:
        print(f"{r['checkpoint']:<11} {r['checkpoint_mb']:>8.1f} {r['tp']:>3} {r['mode']:<17} {r['shard_mb']:>9.1f} "
              f"{r['peak_rss_mb']:>12.1f} {r['delta_rss_mb']:>9.1f} {r['load_s']:>7.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
