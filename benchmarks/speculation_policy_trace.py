"""Replays engine cores' policy traces: checks the k of every step, and times the policy's calls.

An RL run with `trainer.mtp.num_speculative_tokens=auto trainer.mtp.policy_trace_dir=DIR` leaves one trace per
engine core in DIR (speculation/trace.py): every call its scheduler made to the speculation policy. This
feeds each trace to a fresh policy of the current code, `--repeats` times, and reports:

- `all_k_match`: whether the replay chose the k the engine ran at every step (`first_mismatch`: the first step
  where it did not). A trace recorded before a change that should leave the choices alone checks the change on
  the engine's own traffic; a change that moves choices shows where the first one moved.
- `us_per_step`: the policy's time per engine step, all its calls together (choose, timings, verified drafts,
  weight syncs, and reading the file), the fastest of the repeats, in this quiet process.

`--record STEPS OUT_DIR` first runs the tiny default that many RL steps with auto k and the trace on (its run
and traces under OUT_DIR), then replays those traces; `--quick` records two steps at a small size (the smoke
test). Prints a table and writes JSON with `--json OUT`; exits 1 when a trace's choices differ.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from step_time import QUICK_OVERRIDES, run_setup  # (benchmarks/ is this script's first path entry)

from skyrl_mtp.speculation.trace import replay


def record(steps: int, out: Path, overrides: list[str]) -> Path:
    """Run the tiny default `steps` RL steps with auto k and the policy trace on, as step_time.py runs its
    set-ups; returns the traces' directory."""
    traces = out / "traces"
    run_setup("run", ["trainer.mtp.num_speculative_tokens=auto", f"trainer.mtp.policy_trace_dir={traces}"], steps,
              out, overrides)
    return traces


def measure(path: Path, repeats: int) -> dict:
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        first = replay(path)
        seconds.append(time.perf_counter() - t0)
    steps = max(len(first.ks), 1)
    mismatch = first.first_mismatch
    return {"trace": str(path), "steps": len(first.ks), "k_max": first.policy.k_max,
            "explore_budget": first.policy.explore_budget, "all_k_match": mismatch is None, "first_mismatch": mismatch,
            "k_mean": sum(first.recorded) / steps, "us_per_step": min(seconds) / steps * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", type=Path, nargs="*", help="trace files, or directories of them")
    ap.add_argument("--record", nargs=2, metavar=("STEPS", "OUT_DIR"),
                    help="first record traces of a fresh RL run of the tiny default with auto k")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="record two small RL steps and replay them, for the smoke test")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats={args.repeats}: at least 1")
    traces = list(args.traces)
    if args.record:
        if not args.record[0].isdigit() or int(args.record[0]) < 1:
            ap.error(f"--record {args.record[0]}: STEPS is an int >= 1")
        traces.append(record(int(args.record[0]), Path(args.record[1]), []))
    scratch = tempfile.TemporaryDirectory(prefix="policy_trace_")   # --quick's run, removed at exit
    if args.quick:
        traces.append(record(2, Path(scratch.name), QUICK_OVERRIDES))
    if not traces:
        ap.error("give trace files or directories, --record STEPS OUT_DIR, or --quick")
    paths = []
    for p in traces:
        found = sorted(p.glob("policy_trace.*.txt")) if p.is_dir() else [p]
        if not found:
            ap.error(f"{p}: no policy_trace.*.txt in it")
        paths += found
    rows = [measure(p, args.repeats) for p in paths]
    print(f"{'trace':<40}{'steps':>7}{'k mean':>8}{'us/step':>9}  k as recorded")
    for r in rows:
        verdict = "every step" if r["all_k_match"] else f"NO: first differs at step {r['first_mismatch']}"
        print(f"{Path(r['trace']).name[-40:]:<40}{r['steps']:>7}{r['k_mean']:>8.3f}{r['us_per_step']:>9.1f}  {verdict}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))
    return 0 if all(r["all_k_match"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
