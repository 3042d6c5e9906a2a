"""Micro-benchmark of the draft-loss math alone (no Megatron): time and peak memory of forward+backward
of each loss type, from student hidden states through the output projection, chunked and not. Why: it
isolates what chunking buys in memory and costs in time at a realistic vocabulary size; the end-to-end
cost inside a train step is benchmarks/draft_loss.py.

    .venv/bin/python benchmarks/draft_loss_math.py [--n 4096 --vocab 32000 --hidden 512 --chunk 512 --json OUT]

Each configuration runs in its own subprocess so the peak resident memory (Linux VmHWM, reset after
the inputs are built) belongs to that configuration alone. Prints one line per configuration and,
with --json, writes the rows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

# --quick: a smoke size that finishes in seconds; explicit flags still win
QUICK = dict(n=256, vocab=2048, hidden=128, chunk=64, topk=16, repeat=1)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _one(a) -> dict:
    import torch

    from skyrl_mtp.mtp.draft_losses import chunked_draft_loss, draft_loss

    torch.manual_seed(0)
    hidden = torch.randn(a.n, a.hidden) * 0.5
    weight = torch.randn(a.vocab, a.hidden) * 0.05
    teacher = torch.randn(a.n, a.vocab) * 2
    mask = torch.rand(a.n) > 0.1
    target = torch.randint(0, a.vocab, (a.n,))
    kw = dict(loss_type=a.loss_type, target_ids=target, topk=a.topk)
    # warm-up on tiny inputs: first use of checkpointing pays one-off imports and allocations
    small = torch.randn(8, a.hidden, requires_grad=True)
    chunked_draft_loss(small, weight[:64], teacher[:8, :64], mask[:8], chunk_size=4, loss_type=a.loss_type,
                       target_ids=target[:8] % 64, topk=a.topk).loss_sum.backward()
    draft_loss(small @ weight[:64].t(), teacher[:8, :64], mask[:8], loss_type=a.loss_type,
               target_ids=target[:8] % 64, topk=a.topk).loss_sum.backward()
    times = []
    peak = 0
    for _ in range(a.repeat):
        h = hidden.clone().requires_grad_()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = _rss_kib("VmRSS")
        t0 = time.perf_counter()
        if a.chunked:
            out = chunked_draft_loss(h, weight, teacher, mask, chunk_size=a.chunk, **kw)
        else:
            out = draft_loss(h @ weight.t(), teacher, mask, **kw)
        out.loss_sum.backward()
        times.append(time.perf_counter() - t0)
        peak = max(peak, _rss_kib("VmHWM") - base)
        del out, h
    return {"loss_type": a.loss_type, "chunked": a.chunked, "time_ms": 1000 * min(times),
            "peak_mem_mb": peak / 1024, "n": a.n, "vocab": a.vocab, "hidden": a.hidden,
            "chunk": a.chunk if a.chunked else None, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--loss-type", dest="loss_type")
    p.add_argument("--chunked", action="store_true")
    p.add_argument("--child", action="store_true")
    p.add_argument("--quick", action="store_true", help=f"smoke size {QUICK} (explicit flags still win)")
    a = p.parse_args(argv)
    if a.quick:
        p.set_defaults(**QUICK)
        a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_one(a)))
        return
    rows = []
    for lt in ("soft_ce", "hard_ce", "topk_soft_ce", "tv"):
        for chunked in (False, True):
            cmd = [sys.executable, __file__, "--child", "--loss-type", lt, "--n", str(a.n), "--vocab", str(a.vocab),
                   "--hidden", str(a.hidden), "--chunk", str(a.chunk), "--topk", str(a.topk),
                   "--repeat", str(a.repeat)] + (["--chunked"] if chunked else [])
            row = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()
                             .splitlines()[-1])
            rows.append(row)
            print(f"{lt:13s} chunked={str(chunked):5s} time {row['time_ms']:9.1f} ms  "
                  f"peak +{row['peak_mem_mb']:8.1f} MiB", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
