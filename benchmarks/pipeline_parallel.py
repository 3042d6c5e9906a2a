"""tiny_dapo with pipeline parallelism on both sides against PP=1: which metrics agree bit for bit, how far the
rest move, and what PP costs in step time on CPU.

Two real runs of the CLI (Ray, vLLM, Megatron) from the same seeds, data and cached warm start, one after the
other in this invocation:

- pp1: the recipe as it is (one policy rank; engines of one worker),
- pp2: `generator.pipeline_parallel_size=2 megatron.pp=2 trainer.placement.policy_num_workers=2` (each
  engine two worker processes, the drafter on the second; the policy two Megatron ranks, MTP and its own
  optimizer on the second, megatron-core's 1F1B schedule between them on gloo).

Per metric it reports the steps whose values are bitwise equal and the largest absolute and relative
difference; per run the final checkpoint's HF export is compared tensor by tensor. Rollouts are identical as
long as the policies are (the engines' PP equivalence is proven by tests/integration/rollout/
test_pipeline_parallel_engines.py); the pipelined policy's update differs from one process's in the last
bits (the grad norm is summed per stage, then over stages), and sampled rollouts of later steps amplify
that. Step time: mean over steps after the first (`--skip`), ratio pp2 / pp1. No speedup is expected on 2
cores: the stages' processes share them and every micro-batch crosses a process boundary.

    python benchmarks/pipeline_parallel.py [--steps 4] [--skip 1] [--quick] [--json OUT] [override ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# --quick: step_time.py's smoke size (a small batch, short responses, no warm start) for both runs
from step_time import QUICK_OVERRIDES  # (benchmarks/ is this script's first path entry)

REPO = Path(__file__).resolve().parents[1]
SETUPS = {
    "pp1": [],
    "pp2": ["generator.pipeline_parallel_size=2", "megatron.pp=2", "trainer.placement.policy_num_workers=2"],
}
VOLATILE = ("timing/", "tokens_per_s", "seconds", "latency")  # wall-clock metrics


def run_setup(name: str, extra: list[str], steps: int, out: Path, overrides: list[str]) -> tuple[list[dict], Path]:
    run_dir = out / name
    out.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "skyrl_mtp.main", "recipe=tiny_dapo", f"trainer.run_dir={run_dir}",
            f"trainer.total_steps={steps}", "trainer.eval_every_n_steps=0", f"trainer.checkpoint.every_n_steps={steps}",
            "trainer.progress_bar=false", "logger.plots=false", *extra, *overrides]
    proc = subprocess.run(args, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True, capture_output=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, run_dir


def compare_metrics(a: list[dict], b: list[dict]) -> list[dict]:
    """One row per metric both runs log: bitwise-equal steps, largest |a - b| and |a - b| / |a|."""
    by_step_a, by_step_b = {r["step"]: r for r in a}, {r["step"]: r for r in b}
    steps = sorted(set(by_step_a) & set(by_step_b))
    keys = sorted({k for s in steps for k in by_step_a[s] if k in by_step_b[s] and k != "step"})
    rows = []
    for key in keys:
        if any(v in key for v in VOLATILE):
            continue
        pairs = [(by_step_a[s][key], by_step_b[s][key]) for s in steps]
        if not all(isinstance(x, (int, float)) and isinstance(y, (int, float)) for x, y in pairs):
            continue
        equal = sum(x == y for x, y in pairs)
        diffs = [abs(x - y) for x, y in pairs]
        rel = [abs(x - y) / abs(x) if x else (0.0 if x == y else math.inf) for x, y in pairs]
        first = next((s for s, (x, y) in zip(steps, pairs) if x != y), None)
        rows.append({"metric": key, "steps": len(steps), "bitwise_equal_steps": equal, "first_different_step": first,
                     "max_abs_diff": max(diffs), "max_rel_diff": max(rel)})
    return rows


def compare_exports(a: Path, b: Path) -> dict:
    from safetensors.torch import load_file

    ckpts = sorted((a / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    if not ckpts:
        return {"checkpoint": None}
    name = ckpts[-1].name
    wa = load_file(str(a / "checkpoints" / name / "hf" / "model.safetensors"))
    wb = load_file(str(b / "checkpoints" / name / "hf" / "model.safetensors"))
    equal = sum(wa[k].equal(wb[k]) for k in wa if k in wb)
    diff = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa if k in wb)
    return {"checkpoint": name, "tensors": len(wa), "same_names": set(wa) == set(wb), "bitwise_equal_tensors": equal,
            "max_abs_diff": diff}


def step_times(rows: list[dict], skip: int) -> list[float]:
    return [r["timing/step_s"] for r in rows[skip:] if "timing/step_s" in r]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--skip", type=int, default=1, help="steps left out of the step-time means (start-up)")
    ap.add_argument("--quick", action="store_true", help=f"2 steps of a small batch: a smoke run (overrides {QUICK_OVERRIDES})")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--out", type=Path, help="where the run directories go (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="config overrides for both runs")
    args = ap.parse_args(argv)
    steps, skip = (2, 1) if args.quick else (args.steps, args.skip)
    overrides = [*QUICK_OVERRIDES, *args.overrides] if args.quick else args.overrides
    out = args.out or Path(tempfile.mkdtemp(prefix="pp_bench_"))
    runs = {name: run_setup(name, extra, steps, out, overrides) for name, extra in SETUPS.items()}
    (rows1, dir1), (rows2, dir2) = runs["pp1"], runs["pp2"]
    metrics = compare_metrics(rows1, rows2)
    t1, t2 = step_times(rows1, skip), step_times(rows2, skip)
    mean1, mean2 = sum(t1) / max(len(t1), 1), sum(t2) / max(len(t2), 1)
    result = {"steps": steps, "skip": skip, "rows": metrics, "exports": compare_exports(dir1, dir2),
              "step_s": {"pp1": t1, "pp2": t2}, "step_s_mean": {"pp1": mean1, "pp2": mean2},
              "step_ratio_pp2_over_pp1": mean2 / mean1 if mean1 else None,
              "bitwise_equal_metrics": sorted(r["metric"] for r in metrics if r["bitwise_equal_steps"] == r["steps"])}
    print(f"{'metric':58s} {'equal/steps':>11s} {'first diff':>10s} {'max |diff|':>11s} {'max rel':>9s}")
    for r in metrics:
        first = "-" if r["first_different_step"] is None else str(r["first_different_step"])
        print(f"{r['metric']:58s} {r['bitwise_equal_steps']:>5d}/{r['steps']:<5d} {first:>10s} "
              f"{r['max_abs_diff']:11.3g} {r['max_rel_diff']:9.2g}")
    print(f"final HF export: {result['exports']}")
    print(f"step time (mean of steps {skip + 1}..{steps}): pp1 {mean1:.2f} s, pp2 {mean2:.2f} s, "
          f"pp2 / pp1 = {result['step_ratio_pp2_over_pp1']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
