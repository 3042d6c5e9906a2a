"""Host memory of a training batch's layout (policy/batch_layout.py `prepare`): the dense [B, 1, S, S] attention mask
every batch used to carry, against the causal path a batch of one sequence per row takes now (mask None).
Why: at the GPU recipes' shapes (B=64 rows, S=10240) that mask alone is 6.7 GB of host memory per batch, copied to
the device as well.

    .venv/bin/python benchmarks/batch_layout_memory.py [--rows 8 16 --seq 2048 4096 --json OUT] [--quick]

Measured here: the bytes of the prepared batch's tensors and the process's peak RSS growth while preparing it
(VmHWM, reset before each case), side by side in one run; the recipes' shape is computed (B * S * S bytes), not
allocated.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path


def _hwm_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(rows: int, seq: int) -> dict:
    import torch

    from skyrl_mtp.policy.batch_layout import layout_bytes, packed_mask, prepare

    batch = {"input_ids": torch.zeros(rows, seq, dtype=torch.long), "attention_mask": torch.ones(rows, seq, dtype=torch.long),
             "loss_mask": torch.ones(rows, seq, dtype=torch.long)}
    out = {"rows": rows, "seq": seq}
    for name in ("dense_mask", "causal"):
        gc.collect()
        _reset_peak()
        base = _rss_kb()
        prepared = prepare(batch)
        if name == "dense_mask":   # what prepare() built for every batch before: one segment per row
            prepared["megatron_mask"] = packed_mask(torch.zeros(rows, seq, dtype=torch.long))
        out[f"{name}_layout_bytes"] = layout_bytes(prepared)
        out[f"{name}_mask_bytes"] = 0 if prepared["megatron_mask"] is None else prepared["megatron_mask"].numel()
        out[f"{name}_peak_rss_growth_bytes"] = max(_hwm_kb() - base, 0) * 1024
        del prepared
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="one small shape (a smoke run)")
    a = ap.parse_args(argv)
    if a.quick:
        a.rows, a.seq = [2], [512]
    results = [measure(b, s) for b in a.rows for s in a.seq]
    recipe = {"rows": 64, "seq": 10240, "dense_mask_bytes": 64 * 10240 * 10240, "causal_mask_bytes": 0}
    print(f"{'rows':>5} {'seq':>6} {'layout MB before':>17} {'after':>9} {'peak RSS MB before':>19} {'after':>9}")
    for r in results:
        print(f"{r['rows']:>5} {r['seq']:>6} {r['dense_mask_layout_bytes'] / 2**20:>17.1f} "
              f"{r['causal_layout_bytes'] / 2**20:>9.1f} {r['dense_mask_peak_rss_growth_bytes'] / 2**20:>19.1f} "
              f"{r['causal_peak_rss_growth_bytes'] / 2**20:>9.1f}")
    print(f"recipes' shape (computed): rows=64 seq=10240 mask before {recipe['dense_mask_bytes'] / 1e9:.2f} GB, after 0")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": results, "recipe_shape": recipe}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
