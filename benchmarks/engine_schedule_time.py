"""What the engine core costs per plain decode step and per prompt step: no spec, auto k, auto k without the memo or the policy.

An auto-k engine that has stopped drafting should cost what a no-spec engine costs. Its steps then run
the same model work (speculation/policy.py runs them as vLLM's no-spec steps), but the engine
core still schedules them with a speculative config and asks the speculation policy for k. This times that
part on the tiny default's engine, per engine step, as thread CPU time in the engine core (_schedule_timers):

- `vllm_us`: vLLM's own `Scheduler.schedule`;
- `total_us`: the engine's whole `schedule()` (for auto k: vLLM's, plus the policy's choice and the step's
  timing for its cost model);
- `step_us`: the whole step, from its `schedule()` to the next one's: scheduling, the model's forward and
  sampling (the CPU worker runs in the engine core's thread, with one torch thread here, as in a one-CPU
  Ray actor), and the scheduler's update from the output;
- `prompt_token_us`: the same for prompt steps (new requests scheduled, nothing drafted or verified), per
  token they schedule. A rollout's requests arrive over a few such steps, and how many come in each
  depends on how long the steps before took, so the steps are compared per token
  (`prompt_tokens_per_step` says how large they were).

Set-ups: `no_spec` (trainer.mtp.enabled=false), `auto` (trainer.mtp.num_speculative_tokens=auto, as
shipped), `auto_unmemoized` (the same, with vLLM's replay boundaries computed per request and step, as
vLLM 0.32 does once a drafter is configured; vllm_patches/kv_replay_cache.py memoizes them), `auto_no_policy`
(auto's engine and scheduler with the speculation policy's code taken out: k = 0 on every step, no step
timing for its cost model; against `auto`, what the policy's own work costs a step, and against `no_spec`,
what an auto engine costs without it). Each repeat runs
each set-up's engine in its own process, one after another in rotated order, for `--rounds` rollouts of
`--batch` random prompts (the first rollout is a warm-up and not counted). Plain decode steps count with
at least half the batch running: no prompt tokens, no drafts verified or proposed. Thread CPU time leaves
out what other processes take from the engine (the run-to-run noise of wall time on a shared machine).

Prints a table and writes JSON: per set-up `vllm_us`, `total_us`, `step_us` and `prompt_token_us` (mean over
repeats), their per-repeat values, and `*_ratio_over_no_spec` / `*_ratio_range` for each (per repeat, the
set-up's mean over the no-spec engine's of the same repeat; their mean and range).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
SETUPS = {
    "no_spec": (["trainer.mtp.enabled=false"], "_schedule_timers.TimedScheduler"),
    "auto": (["trainer.mtp.num_speculative_tokens=auto"], "_schedule_timers.TimedAdaptive"),
    "auto_unmemoized": (["trainer.mtp.num_speculative_tokens=auto"], "_schedule_timers.TimedAdaptiveUnmemoized"),
    "auto_no_policy": (["trainer.mtp.num_speculative_tokens=auto"], "_schedule_timers.TimedAdaptiveNoPolicy"),
}
QUICK = dict(rounds=2, batch=8, max_tokens=24, repeats=1)
PARTS = ("vllm", "total", "step", "prompt_token")
LABELS = {"vllm": "vLLM schedule", "total": "schedule()", "step": "plain step", "prompt_token": "prompt token"}


def child(setup: str, rounds: int, batch: int, max_tokens: int, out_prefix: str) -> None:
    """One engine of `setup` in this process: `rounds` rollouts, a prefix-cache reset after each (the
    timer's dump; the first dump, after the warm-up rollout, is the baseline the others are counted from)."""
    from dataclasses import fields

    from skyrl_mtp.config.loader import load_config
    from skyrl_mtp.rollout.config import EngineConfig
    from skyrl_mtp.rollout.engine import InferenceEngine
    from skyrl_mtp.rollout.sampling import SamplingSpec
    from skyrl_mtp.runtime_env import configure_offline_caches
    from skyrl_mtp.trainer import run_plan as build
    from skyrl_mtp.trainer.launch import resolve_model

    overrides, scheduler_cls = SETUPS[setup]
    cache = Path(os.environ.get("SKYRL_MTP_CACHE", REPO / ".cache"))
    configure_offline_caches(str(cache))
    cfg = load_config(["recipe=tiny_dapo", *overrides])
    base = build.engine_config(cfg, resolve_model(build.build_run_plan(cfg), cache))   # the model the run itself would serve

    class Timed(EngineConfig):
        """The run's engine config with this benchmark's timing scheduler (the same class otherwise)."""

        @property
        def adaptive_scheduler_cls(self) -> str:
            return scheduler_cls

    eng_cfg = Timed(**{f.name: getattr(base, f.name) for f in fields(EngineConfig)})
    eng_cfg.max_num_seqs = max(eng_cfg.max_num_seqs, batch)
    os.environ["SKYRL_BENCH_SCHED_OUT"] = out_prefix
    os.environ["SKYRL_BENCH_SCHED_MIN_BATCH"] = str(max(batch // 2, 1))

    async def run() -> None:
        engine = InferenceEngine(eng_cfg)
        await engine.ready()
        rng = random.Random(0)
        for r in range(rounds):
            prompts = [[rng.randrange(10, 200) for _ in range(16)] for _ in range(batch)]
            await engine.generate(prompts, SamplingSpec(temperature=1.0, max_tokens=max_tokens, seed=r),
                                  list(range(batch)))
            await engine._engine.reset_prefix_cache()
            if r == 0:
                baseline = _read(out_prefix)
                Path(out_prefix + ".baseline").write_text(json.dumps(baseline))
        await engine.shutdown()

    asyncio.run(run())


def _read(prefix: str) -> dict:
    docs = [json.loads(Path(p).read_text()) for p in glob.glob(prefix + ".[0-9]*")]
    if len(docs) != 1:
        raise RuntimeError(f"expected one engine core's timings under {prefix}.*, found {len(docs)}")
    return docs[0]


def run_setup(setup: str, a: argparse.Namespace, tmp: str, tag: str) -> dict:
    prefix = os.path.join(tmp, f"{setup}-{tag}")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", setup, "--rounds", str(a.rounds),
           "--batch", str(a.batch), "--max-tokens", str(a.max_tokens), "--out-prefix", prefix]
    # one torch thread, as in the one-CPU Ray actor that hosts each engine of a run: the engine core's thread
    # then does all of a step's work, which its thread CPU time measures
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{setup} engine failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    end, start = _read(prefix), json.loads(Path(prefix + ".baseline").read_text())
    steps = end["steps"] - start["steps"]
    if steps <= 0:
        raise RuntimeError(f"{setup}: no plain decode steps were timed after the warm-up rollout")
    prompt_steps = end["prompt_steps"] - start["prompt_steps"]
    if prompt_steps <= 0:
        raise RuntimeError(f"{setup}: no prompt steps were timed after the warm-up rollout")
    prompt_tokens = end["prompt_tokens"] - start["prompt_tokens"]
    return {"steps": steps, "vllm_us": (end["vllm_s"] - start["vllm_s"]) / steps * 1e6,
            "total_us": (end["total_s"] - start["total_s"]) / steps * 1e6,
            "step_us": (end["step_s"] - start["step_s"]) / steps * 1e6, "prompt_steps": prompt_steps,
            "prompt_token_us": (end["prompt_s"] - start["prompt_s"]) / prompt_tokens * 1e6,
            "prompt_tokens_per_step": prompt_tokens / prompt_steps,
            "memo_hits": end["memo_hits"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    ap.add_argument("--rounds", type=int, default=8, help="rollouts per engine, the first a warm-up")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a small run, for the smoke test")
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out-prefix", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.rounds, a.batch, a.max_tokens, a.out_prefix)
        return
    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, v)
    for name in ("rounds", "batch", "max_tokens", "repeats"):
        if getattr(a, name) < (2 if name == "rounds" else 1):
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= {2 if name == 'rounds' else 1}")
    if "no_spec" not in a.setups:
        ap.error("--setups must include no_spec (the ratios are over it)")

    per_repeat: dict[str, list[dict]] = {s: [] for s in a.setups}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeats):
            order = a.setups[rep % len(a.setups):] + a.setups[:rep % len(a.setups)]
            for s in order:
                per_repeat[s].append(run_setup(s, a, tmp, str(rep)))
                r = per_repeat[s][-1]
                print(f"repeat {rep} {s:16s} steps {r['steps']:5d}  vllm {r['vllm_us']:7.1f} us  total "
                      f"{r['total_us']:7.1f} us  step {r['step_us']:8.1f} us  prompt steps {r['prompt_steps']:4d} "
                      f"of {r['prompt_tokens_per_step']:.0f} tokens, {r['prompt_token_us']:6.2f} us a token", flush=True)

    rows = []
    ref = per_repeat["no_spec"]
    for s in a.setups:
        reps = per_repeat[s]
        row = {"setup": s, "steps": sum(r["steps"] for r in reps), "memo_hits": reps[-1]["memo_hits"],
               "prompt_steps": sum(r["prompt_steps"] for r in reps),
               "prompt_tokens_per_step": statistics.fmean(r["prompt_tokens_per_step"] for r in reps)}
        for part in PARTS:
            vals = [r[f"{part}_us"] for r in reps]
            ratios = [r[f"{part}_us"] / n[f"{part}_us"] for r, n in zip(reps, ref)]
            row[f"{part}_us"] = statistics.fmean(vals)
            row[f"{part}_us_per_repeat"] = vals
            row[f"{part}_ratio_over_no_spec"] = statistics.fmean(ratios)
            row[f"{part}_ratio_range"] = [min(ratios), max(ratios)]
        rows.append(row)

    print(f"\nplain decode steps with >= {max(a.batch // 2, 1)} of {a.batch} sequences, {a.repeats} repeats, "
          f"{a.rounds - 1} measured rollouts each (thread CPU time in the engine core)")
    print(f"{'setup':16s}" + "".join(f" {LABELS[p] + ' us':>15s} {'ratio':>6s} {'range':>13s}" for p in PARTS))
    for r in rows:
        print(f"{r['setup']:16s}" + "".join(
            f" {r[p + '_us']:15.1f} {r[p + '_ratio_over_no_spec']:6.3f} "
            f"{r[p + '_ratio_range'][0]:6.3f}-{r[p + '_ratio_range'][1]:.3f}" for p in PARTS))
    if a.json:
        Path(a.json).write_text(json.dumps({"batch": a.batch, "rounds": a.rounds, "max_tokens": a.max_tokens,
                                            "repeats": a.repeats, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
