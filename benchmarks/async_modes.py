"""Steps per second of the RL loop's asynchronous modes against sync on the tiny default, MTP on and off, and
where each step's time goes (docs/async.md describes the modes and their timing/* metrics).

Set-ups, each one real run of the CLI through step_time.py's runner (same seeds and data; no eval, checkpoints
or plots):

- sync, sync_no_mtp:                 trainer.async_rl.mode=sync, with MTP speculative decoding and the draft
                                     head's training (the recipe) and without (trainer.mtp.enabled=false);
- one_step_off, one_step_off_no_mtp: the next batch is generated while the step trains;
- fully_async, fully_async_no_mtp:   mode=fully_async with max_staleness=1. Run only when --setups names
                                     them. One the config refuses (every set-up is validated here before
                                     anything runs) is reported as refused and skipped; one whose run fails is
                                     reported as failed, and the other set-ups still run.

`--repeats R` runs every set-up R times in alternating order (A B C, C B A, ...), so a drifting machine
shifts them alike. Means are over the measured steps: after the first `--skip` (start-up, the untrained head),
and without the last `--drop-last`. The last step has no next batch to generate ahead, so an async run's last
step does no generation at all; counting it would credit the async modes with one generation they never
did. The table gives each set-up's steps per second and its ratio to sync with the same MTP setting. The
ratio has a 95% interval from step_time.py's two-level bootstrap: repeats drawn with replacement, then steps
inside each drawn repeat, step j of both runs paired. The timeline gives the mean seconds per step of every
timing/* metric the runs log. The main thread's phases add up to `step`. background/* is the generation of
the step's batch on the producer thread, which ran beside earlier steps' main threads. `engines_idle`, which
the async modes log, is for sync the step less its own generation and scoring.

--long-tail: the runs read a prompt file written next to them, in the tiny default's task. Its rows are the
synthetic arithmetic questions, and every TAIL_EVERY-th question is followed by TAIL_FILLER (a run of digits
that takes the prompt to ~430 tokens). The tiny model was warm-started on ~30-token prompts, and at positions
it never trained on it does not stop. Those responses mostly run to the long-tail max_tokens of 64 tokens,
against ~8-17 for the other prompts (4-8x). The prompts are read in order (data.shuffle=false), so every
16-prompt batch holds 2 of them. Their rewards come out all 0, so dynamic sampling drops their groups: they
cost generation, not training (a group whose rewards differ would be trained on its longer sequences).
`gen_tok` (tokens generated per step, dropped groups included) shows the tail: 4821 against 3173 on the tiny
default. A long prompt is the only way found to make the tiny model's answers long with no change outside
benchmarks/.

    python benchmarks/async_modes.py [--steps 12] [--skip 2] [--repeats 2] [--setups a,b] [--long-tail]
                                     [--quick] [--json OUT] [--keep-runs DIR] [override ...]

--quick: 2 runs (sync and one_step_off, MTP on) of 3 steps of a small batch with the long tail, no warm start.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

# benchmarks/ is this script's first path entry
from step_time import QUICK_OVERRIDES, RunFailed, after_skip, cli_overrides, ratio_ci95, run_setup

MODES = {
    "sync": ["trainer.async_rl.mode=sync"],
    "one_step_off": ["trainer.async_rl.mode=one_step_off"],
    "fully_async": ["trainer.async_rl.mode=fully_async", "trainer.async_rl.max_staleness=1"],
}
NO_MTP = "_no_mtp"
SETUPS = {f"{mode}{suffix}": [*overrides, *([] if not suffix else ["trainer.mtp.enabled=false"])]
          for mode, overrides in MODES.items() for suffix in ("", NO_MTP)}
DEFAULT_SETUPS = ("sync", "one_step_off", "sync_no_mtp", "one_step_off_no_mtp")
ON_REQUEST = ("fully_async", "fully_async_no_mtp")   # run only when named; skipped when the config refuses them
# the timeline's phases in the loop's order, those the runs log; any other timing/* metric a run logs follows
TIMELINE = ("generate", "reward", "old_logprobs", "train", "wait_rollout", "pause", "sync", "background/generate",
            "background/reward", "overlap", "engines_idle", "step")
QUICK = dict(steps=3, skip=1, repeats=1, setups="sync,one_step_off", long_tail=True)

TAIL_EVERY = 8
TAIL_FILLER = " " + "1 2 3 4 5 6 7 8 9 0 " * 20
TAIL_ROWS = 2000
LONG_TAIL_OVERRIDES = ["data.shuffle=false", "data.max_prompt_length=448", "generator.max_model_len=512",
                       "generator.sampling.max_tokens=64"]


def baseline(setup: str) -> str:
    """The sync set-up a set-up's ratio is taken against: sync with the same MTP setting."""
    return "sync" + (NO_MTP if setup.endswith(NO_MTP) else "")


def long_tail_rows(n: int = TAIL_ROWS, every: int = TAIL_EVERY, digits: int = 1, seed: int = 0) -> list[dict]:
    """The tiny default's arithmetic questions (DAPO-Math layout), row i followed by TAIL_FILLER when
    i % every == 0; its answer and ground truth are unchanged."""
    from skyrl_mtp.data.arithmetic_task import ArithmeticTaskConfig, generate_rows

    rows = generate_rows(ArithmeticTaskConfig(digits=digits, num_train=n, num_test=0, seed=seed))["train"]
    for i, row in enumerate(rows):
        if i % every == 0:
            row["prompt"][0]["content"] += TAIL_FILLER
            row["extra_info"]["long_tail"] = True
    return rows


def write_long_tail(path: Path) -> list[str]:
    """Write the long-tail prompt file; returns the overrides that make a run read it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in long_tail_rows()))
    return [f"data.train_files=[{path}]", *LONG_TAIL_OVERRIDES]


def refusal(overrides: list[str]) -> str | None:
    """The config's refusal of a run with these CLI arguments (the CLI's own validation), None if it is valid."""
    from skyrl_mtp.config import ConfigError, load_config

    try:
        load_config(overrides)
    except ConfigError as err:
        return str(err)
    return None


def measured(rows: list[dict], skip: int, drop_last: int) -> list[dict]:
    """The steps the means use: after the first `skip`, without the last `drop_last`."""
    kept = after_skip(rows, skip)
    return kept[:len(kept) - drop_last] if len(kept) > drop_last else kept


def phase_seconds(row: dict, phase: str) -> float:
    """A step's seconds in a timeline phase. engines_idle, which the async modes log, is for a sync step the
    step less its own generation and scoring."""
    if phase == "engines_idle" and "timing/engines_idle_s" not in row:
        own = row.get("timing/generate_s", 0.0) + row.get("timing/reward_s", 0.0)
        return max(row.get("timing/step_s", 0.0) - own, 0.0)
    return row.get(f"timing/{phase}_s", 0.0)


def timeline_phases(runs: list[list[dict]]) -> list[str]:
    """The TIMELINE phases the runs log (engines_idle always), then every other timing/* metric they log (eval,
    checkpoint, a new mode's phases)."""
    logged = {k.removeprefix("timing/").removesuffix("_s") for run in runs for r in run for k in r
              if k.startswith("timing/") and k.endswith("_s")} | {"engines_idle", "step"}
    return [p for p in TIMELINE if p in logged] + sorted(logged - set(TIMELINE))


def mean_metric(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else None


def summarize_setup(runs: list[list[dict]], phases: list[str]) -> tuple[dict, list[dict]]:
    """A set-up's row (steps per second, mean timeline, rollout means) and its runs' per-step phase times,
    from the measured steps of each run."""
    steps = [r for run in runs for r in run]
    per_step = [{p: [phase_seconds(r, p) for r in run] for p in phases} for run in runs]
    total = sum(r["timing/step_s"] for r in steps)
    row = {"steps_per_s": len(steps) / total, "step_s": total / len(steps),
           "timeline": {p: sum(phase_seconds(r, p) for r in steps) / len(steps) for p in phases},
           "acceptance": mean_metric(steps, "rollout/train/draft_acceptance_rate"),
           "reward": mean_metric(steps, "reward/mean"),
           "response_length": mean_metric(steps, "rollout/response_length_mean"),   # of the groups trained
           "generated_tokens": mean_metric(steps, "rollout/train/generated_tokens"),   # every round's, dropped too
           "staleness": mean_metric(steps, "async/staleness_mean")}
    return row, per_step


def with_ratios(rows: dict[str, dict], per_step: dict[str, list[dict]]) -> dict[str, dict]:
    """Each row's steps per second over its sync baseline's (in place), with the bootstrap interval and the
    ratio of each repeat; None where the baseline was not run."""
    for name, row in rows.items():
        base = baseline(name)
        row["baseline"] = base
        if base not in per_step:
            row.update(ratio_vs_sync=None, ratio_ci95=None, ratio_per_repeat=None)
            continue
        base_runs, runs = [r["step"] for r in per_step[base]], [r["step"] for r in per_step[name]]
        # steps per second of the set-up over sync's = sync's mean step time over the set-up's
        row["ratio_vs_sync"] = rows[base]["step_s"] / row["step_s"]
        row["ratio_ci95"] = list(ratio_ci95(base_runs, runs))
        row["ratio_per_repeat"] = [sum(b) / sum(r) for b, r in zip(base_runs, runs)]
    return rows


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: dict[str, dict], refused: dict[str, str], failed: dict[str, str]) -> None:
    print(f"{'setup':<21}{'steps/s':>9}{'step_s':>9}{'x sync':>8}{'95% CI':>15}  {'per repeat':<20}"
          f"{'accept':>8}{'reward':>8}{'resp_len':>9}{'gen_tok':>8}{'stale':>7}")
    for name, r in rows.items():
        ci = "" if r["ratio_ci95"] is None else f"{r['ratio_ci95'][0]:.3f}-{r['ratio_ci95'][1]:.3f}"
        reps = "" if r["ratio_per_repeat"] is None else " ".join(f"{x:.3f}" for x in r["ratio_per_repeat"])
        print(f"{name:<21}{r['steps_per_s']:>9.3f}{r['step_s']:>9.3f}{_fmt(r['ratio_vs_sync'], '.3f'):>8}{ci:>15}  "
              f"{reps:<20}{_fmt(r['acceptance'], '.3f'):>8}{_fmt(r['reward'], '.3f'):>8}"
              f"{_fmt(r['response_length'], '.1f'):>9}{_fmt(r['generated_tokens'], '.0f'):>8}"
              f"{_fmt(r['staleness'], '.2f'):>7}")
    for name, why in refused.items():
        print(f"{name:<21}refused by the config: {why}")
    for name, why in failed.items():
        print(f"{name:<21}run failed: {why.splitlines()[0]}")
    print("x sync: steps per second over sync's with the same MTP setting (sync_no_mtp for the *_no_mtp set-ups); "
          "resp_len: mean length of the trained responses; gen_tok: tokens generated for the step's batch, dropped "
          "groups included")


def print_timeline(rows: dict[str, dict], phases: list[str]) -> None:
    names = list(rows)
    width = max(12, *(len(n) + 2 for n in names))
    print(f"{'seconds per step':<22}" + "".join(f"{n:>{width}}" for n in names))
    for p in phases:
        print(f"{p:<22}" + "".join(f"{rows[n]['timeline'][p]:>{width}.3f}" for n in names))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the means")
    ap.add_argument("--drop-last", type=int, default=1,
                    help="last steps left out of the means (an async run's last step generates nothing ahead)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of every set-up, in alternating order")
    ap.add_argument("--setups", default=",".join(DEFAULT_SETUPS),
                    help=f"comma list of {list(SETUPS)}; each needs its sync baseline; {list(ON_REQUEST)} only "
                         "when named")
    ap.add_argument("--long-tail", action="store_true", help="every 8th prompt answered 4-8x longer (see above)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep-runs", type=Path, default=None,
                    help="keep every run's directory (metrics.jsonl, config) under this folder")
    ap.add_argument("--quick", action="store_true", help=f"smoke size {QUICK} with overrides {QUICK_OVERRIDES}")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every set-up")
    a = ap.parse_args(argv)
    if a.quick:
        ap.set_defaults(**QUICK)
        a = ap.parse_args(argv)
        a.overrides = [*QUICK_OVERRIDES, *a.overrides]
    setups = [s for s in a.setups.split(",") if s]
    unknown = sorted(set(setups) - set(SETUPS))
    orphans = sorted(s for s in setups if baseline(s) not in setups)
    if unknown or orphans or not setups:
        ap.error(f"--setups={a.setups!r}: unknown {unknown}, without their sync baseline {orphans}; allowed: "
                 f"{list(SETUPS)}, each with sync (MTP on) or sync_no_mtp (off) beside it")
    if a.repeats < 1 or a.skip < 0 or a.drop_last < 0 or a.steps - a.skip - a.drop_last < 1:
        ap.error(f"--steps={a.steps} must leave a measured step after --skip={a.skip} and --drop-last="
                 f"{a.drop_last}, and --repeats={a.repeats} must be >= 1")
    with tempfile.TemporaryDirectory(prefix="async_modes_") as tmp:
        root = a.keep_runs or Path(tmp)
        overrides = (write_long_tail(root / "long_tail.jsonl") if a.long_tail else []) + a.overrides
        refused = {}
        for name in setups:
            why = refusal(cli_overrides(root / "check" / name, SETUPS[name], a.steps, overrides))
            if why is not None and name not in ON_REQUEST:
                ap.error(f"{name}: the config refuses it: {why}")
            if why is not None:
                refused[name] = why
        setups = [s for s in setups if s not in refused]
        runs: dict[str, list[list[dict]]] = {name: [] for name in setups}
        failed: dict[str, str] = {}
        for rep in range(a.repeats):
            for name in (setups if rep % 2 == 0 else setups[::-1]):
                if name in failed:
                    continue
                try:
                    rows = run_setup(name, SETUPS[name], a.steps, root / f"rep{rep}", overrides)
                except RunFailed as err:   # a mode still being built ends only its own set-up
                    if name not in ON_REQUEST:
                        raise
                    failed[name] = str(err.code)
                    print(f"{name}: {err.code}", file=sys.stderr)
                    continue
                runs[name].append(measured(rows, a.skip, a.drop_last))
    runs = {name: rs for name, rs in runs.items() if name not in failed}
    phases = timeline_phases([run for rs in runs.values() for run in rs])
    summaries = {name: summarize_setup(rs, phases) for name, rs in runs.items()}
    rows = with_ratios({n: s[0] for n, s in summaries.items()}, {n: s[1] for n, s in summaries.items()})
    print(f"{a.steps} steps, measured {a.skip + 1}..{a.steps - a.drop_last}, {a.repeats} repeat(s)"
          f"{', long tail' if a.long_tail else ''}")
    print_table(rows, refused, failed)
    print()
    print_timeline(rows, phases)
    if a.json:
        a.json.write_text(json.dumps({
            "steps": a.steps, "skip": a.skip, "drop_last": a.drop_last, "repeats": a.repeats,
            "long_tail": a.long_tail, "overrides": overrides, "refused": refused, "failed": failed, "phases": phases,
            "rows": [{"setup": n, **r} for n, r in rows.items()],
            "per_step": {n: s[1] for n, s in summaries.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
