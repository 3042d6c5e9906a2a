"""RL step time on the tiny default, split into generate / reward / train / sync, for these set-ups:

- spec_auto:      the product with trainer.mtp.num_speculative_tokens=auto: k per engine step chosen from
                  the running batch, live acceptance and on-engine timings (speculation/policy.py);
                  the head trains the depths the engines drafted, as often as their drafts' savings
                  plus trainer.mtp.idle_head_train_budget of the step time pay for (head_depths,
                  head_trained_share, and head_cost_s: its training and push per measured step),
- spec_auto_no_explore: the same with trainer.mtp.explore_budget=0: the engines explore only where it
                  is predicted to cost nothing (the price of watching for a head that got better),
- spec_mtp_train: MTP speculative decoding with the draft head trained, fixed k (the recipe's),
- spec_vllm_coupling: the same with vLLM's own rejection-sampling coupling instead of the
                  draft-invariant one (generator.draft_invariant_sampling=false): the price of the
                  position-keyed sampler,
- spec_no_train:  speculative decoding with the draft loss weight 0 (the head never improves),
- no_spec:        no speculative decoding, no head training (trainer.mtp.enabled=false).

Each set-up is one real run of the CLI (Ray, vLLM, Megatron) with the same seeds and data; the
warm start is cached so only the first run pays for it. Means are over steps after the first
(`--skip`), and ratios are taken against no_spec from the same invocation. `--repeats R` runs every
set-up R times in alternating order (means over all runs; the ratios of each repeat are listed too).
On a shared machine whole runs differ more than the steps inside one, so each headline ratio also
carries a 95% interval (`*_ratio_ci95`) from a two-level bootstrap: repeats (a spec run with the no_spec
run beside it) drawn with replacement, then step indices inside each drawn repeat (step j of both runs
does the same work). With one repeat it sees step noise only. The per-step times of every run are in
the JSON (`per_step`).

A run's speed is largely set when it starts (its fresh engines and processes on a shared machine), and
that run-to-run factor moves every phase alike. The `*_ratio_speed_normalised` figures divide it out:
each run's time is taken per second of its `policy_work`, the policy's own forward (old_logprobs) and
update (train less `train/head_seconds`, what training the MTP head added), work both set-ups do identically (the
policy forward skips the MTP block; engines idle in both). Their intervals come from the same bootstrap.
They cannot see a cost that speculation adds to that policy work itself (it would cancel), which the
raw ratios still carry.

A few percent needs more repeats than one sitting allows on a noisy machine: `--pool A.json B.json ...`
runs nothing and reports the repeats of earlier invocations' `--json` outputs (same `--steps`, `--skip`
and `--setups`) together, as if one invocation had run them all.

    python benchmarks/step_time.py [--steps 12] [--repeats 1] [--setups a,b] [--quick] [--json OUT] [override ...]
    python benchmarks/step_time.py --pool A.json B.json [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETUPS = {
    "spec_auto": ["trainer.mtp.num_speculative_tokens=auto"],
    "spec_auto_no_explore": ["trainer.mtp.num_speculative_tokens=auto", "trainer.mtp.explore_budget=0"],
    "spec_mtp_train": [],
    "spec_vllm_coupling": ["generator.draft_invariant_sampling=false"],
    "spec_no_train": ["trainer.mtp.loss_weight=0.0"],
    "no_spec": ["trainer.mtp.enabled=false"],
}
PHASES = ("generate", "reward", "old_logprobs", "train", "sync", "step")
REFERENCE = "policy_work"   # the same work in every set-up: the speed meter of the normalised ratios
# --quick: a smoke size (two set-ups, 2 steps of a small batch, no warm start); explicit flags and
# overrides still win (later Hydra overrides replace earlier ones)
QUICK = dict(steps=2, skip=1, setups="spec_auto,no_spec")
QUICK_OVERRIDES = ["trainer.warm_start.enabled=false", "trainer.train_batch_size=2", "trainer.policy_mini_batch_size=2",
                   "generator.n_samples_per_prompt=2", "generator.sampling.max_tokens=8",
                   "algorithm.dynamic_sampling.max_gen_rounds=1"]


def cli_overrides(run_dir: Path, extra: list[str], steps: int, overrides: list[str]) -> list[str]:
    """The CLI's arguments for one set-up's run: the tiny default without eval, checkpoints or plots."""
    return ["recipe=tiny_dapo", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
            "trainer.eval_every_n_steps=0", "trainer.checkpoint.every_n_steps=0", "trainer.progress_bar=false",
            "logger.plots=false", *extra, *overrides]


class RunFailed(SystemExit):
    """A set-up's CLI run exited non-zero. Uncaught, it ends the benchmark with its message."""


def run_setup(name: str, extra: list[str], steps: int, out: Path, overrides: list[str]) -> list[dict]:
    run_dir = out / name
    out.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "skyrl_mtp.main", *cli_overrides(run_dir, extra, steps, overrides)]
    proc = subprocess.run(args, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True,
                          capture_output=True)
    if proc.returncode != 0:
        raise RunFailed(f"{name}: run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def after_skip(rows: list[dict], skip: int) -> list[dict]:
    """The steps the means use: those after the first `skip` (all of them when there are no more)."""
    return [r for r in rows if r["step"] > skip] or rows


def summarize(rows: list[dict], skip: int) -> dict[str, float]:
    rows = after_skip(rows, skip)
    out = {p: sum(r.get(f"timing/{p}_s", 0.0) for r in rows) / len(rows) for p in PHASES}
    out["acceptance"] = sum(r.get("rollout/train/draft_acceptance_rate", 0.0) for r in rows) / len(rows)
    out["tokens_per_s"] = sum(r.get("rollout/train/tokens_per_s", 0.0) for r in rows) / len(rows)
    out["reward_mean"] = sum(r.get("reward/mean", 0.0) for r in rows) / len(rows)   # "reward" is the phase's time
    ks = [r["rollout/train/speculation_k_mean"] for r in rows if "rollout/train/speculation_k_mean" in r]
    out["k_mean"] = sum(ks) / len(ks) if ks else None   # auto only: mean drafts chosen per engine step
    depths = [r["train/head_depths"] for r in rows if "train/head_depths" in r]
    out["head_depths"] = sum(depths) / len(depths) if depths else None   # auto only: depths the head trained
    trained = [r["train/head_trained"] for r in rows if "train/head_trained" in r]
    out["head_trained_share"] = sum(trained) / len(trained) if trained else None   # auto only: steps it trained
    # auto only: what training the head and pushing it to the engines took, per measured step. It trains in
    # bursts (every ~14th step at the default budget), so a short window holds one burst or none
    out["head_cost_s"] = (sum(r.get("train/head_cost_s", 0.0) for r in rows) / len(rows)) if trained else None
    return out


def policy_work(row: dict) -> float:
    """Seconds of the step spent on work every set-up does alike: the policy's forward for old logprobs
    and its update, less what training the MTP head added to the update (`train/head_seconds`, summed over
    the step's mini-batches)."""
    return (row.get("timing/old_logprobs_s", 0.0) + row.get("timing/train_s", 0.0)
            - row.get("train/head_seconds", 0.0))


def step_times(rows: list[dict], skip: int, phase: str) -> list[float]:
    """One phase's time per step (or REFERENCE's), for the steps the means use."""
    if phase == REFERENCE:
        return [policy_work(r) for r in after_skip(rows, skip)]
    return [r.get(f"timing/{phase}_s", 0.0) for r in after_skip(rows, skip)]


def ratio_ci95(spec_runs: list[list[float]], base_runs: list[list[float]], draws: int = 2000,
               seed: int = 0, spec_ref: list[list[float]] | None = None,
               base_ref: list[list[float]] | None = None) -> tuple[float, float]:
    """95% bootstrap interval of mean(spec steps) / mean(base steps). spec_runs[i] and base_runs[i] are the
    per-step times of the two runs of repeat i, step j of both doing the same work (same seeds and data,
    and sampling that drafting does not change). A draw takes repeats with replacement, then step indices
    with replacement inside each, keeping the pairs together. With spec_ref / base_ref (per-step times of
    the reference work, shaped like the runs) it is the interval of the speed-normalised ratio
    (sum spec / sum spec_ref) / (sum base / sum base_ref), the references drawn with their steps."""
    if len(spec_runs) != len(base_runs) or not spec_runs or any(
            len(s) != len(b) or not s for s, b in zip(spec_runs, base_runs)):
        raise ValueError(f"need the same number (>= 1) of spec and base runs, paired runs of the same (>= 1) "
                         f"steps; got {[len(r) for r in spec_runs]} and {[len(r) for r in base_runs]}")
    if (spec_ref is None) != (base_ref is None):
        raise ValueError("give both spec_ref and base_ref, or neither")
    normalised = spec_ref is not None
    if normalised and ([len(r) for r in spec_ref] != [len(r) for r in spec_runs]
                       or [len(r) for r in base_ref] != [len(r) for r in base_runs]):
        raise ValueError(f"the reference times must be shaped like the runs: got {[len(r) for r in spec_ref]} "
                         f"and {[len(r) for r in base_ref]} for runs of {[len(r) for r in spec_runs]}")
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        spec_sum = base_sum = spec_ref_sum = base_ref_sum = 0.0
        for i in rng.choices(range(len(spec_runs)), k=len(spec_runs)):
            spec, base = spec_runs[i], base_runs[i]
            for j in rng.choices(range(len(spec)), k=len(spec)):
                spec_sum, base_sum = spec_sum + spec[j], base_sum + base[j]
                if normalised:
                    spec_ref_sum, base_ref_sum = spec_ref_sum + spec_ref[i][j], base_ref_sum + base_ref[i][j]
        ratios.append(spec_sum / base_sum * (base_ref_sum / spec_ref_sum if normalised else 1.0))
    ratios.sort()
    return ratios[int(0.025 * (draws - 1))], ratios[int(0.975 * (draws - 1))]


def normalised_ratio(spec_runs: list[list[float]], base_runs: list[list[float]],
                     spec_ref: list[list[float]], base_ref: list[list[float]]) -> float:
    """(total spec time / total spec reference time) / (the same for base), pooled over every run."""
    def total(runs: list[list[float]]) -> float:
        return sum(sum(r) for r in runs)
    return total(spec_runs) / total(spec_ref) / (total(base_runs) / total(base_ref))


HEADLINE_SETUPS = ("spec_auto", "spec_mtp_train", "spec_no_train", "spec_vllm_coupling", "spec_auto_no_explore")
ROW_MEANS = ("acceptance", "tokens_per_s", "reward", "k_mean", "head_depths", "head_trained_share", "head_cost_s")


def with_ratios_to_no_spec(rows: list[dict]) -> list[dict]:
    """Add each row's generate and step ratios to the no_spec row's (in place; returns the rows)."""
    base = next(r for r in rows if r["setup"] == "no_spec")
    for r in rows:
        r["generate_ratio_vs_no_spec"] = r["generate_s"] / base["generate_s"]
        r["step_ratio_vs_no_spec"] = r["step_s"] / base["step_s"]
    return rows


def setup_rows(results: dict[str, dict]) -> list[dict]:
    """One JSON row per set-up (`summarize` output), with its ratios to no_spec."""
    return with_ratios_to_no_spec([
        {"setup": name, **{f"{p}_s": r[p] for p in PHASES}, "acceptance": r["acceptance"],
         "tokens_per_s": r["tokens_per_s"], "reward": r["reward_mean"], "k_mean": r["k_mean"],
         "head_depths": r["head_depths"], "head_trained_share": r["head_trained_share"],
         "head_cost_s": r["head_cost_s"]}
        for name, r in results.items()])


def print_rows(rows: list[dict]) -> None:
    print(f"{'setup':<20}" + "".join(f"{p + '_s':>16}" for p in PHASES)
          + f"{'accept':>8}{'tok/s':>9}{'gen/no_spec':>13}{'step/no_spec':>14}")
    for r in rows:
        print(f"{r['setup']:<20}" + "".join(f"{r[p + '_s']:>16.3f}" for p in PHASES)
              + f"{r['acceptance']:>8.3f}{r['tokens_per_s']:>9.0f}{r['generate_ratio_vs_no_spec']:>13.2f}"
              f"{r['step_ratio_vs_no_spec']:>14.2f}")
    for r in rows:
        if r.get("head_cost_s") is not None:
            print(f"{r['setup']}: the head trained on {r['head_trained_share']:.1%} of the measured steps; its "
                  f"training and push took {r['head_cost_s']:.3f} s per step ({r['head_cost_s'] / r['step_s']:.1%} "
                  "of the step)")


def headline_ratios(per_step: dict[str, list[dict]], spec: str | None = None) -> dict:
    """The headline figures from the runs' per-step times (`per_step`: set-up -> one {phase: times} per
    run, run i of every set-up one repeat): the product set-up (auto k when measured, else the fixed-k one;
    or `spec`) over no_spec, raw and speed-normalised, each with its bootstrap interval, and per repeat."""
    spec = spec or next((n for n in HEADLINE_SETUPS if n in per_step), None)
    headline: dict = {"spec_setup": spec, "step_ratio_spec_over_nospec": None, "generate_ratio_spec_over_nospec": None}
    if spec is None:
        return headline

    def series(name: str, p: str) -> list:
        return [run[p] for run in per_step[name]]

    def mean(name: str, p: str) -> float:
        return sum(map(sum, series(name, p))) / sum(map(len, series(name, p)))

    for p in ("step", "generate"):
        headline[f"{p}_ratio_spec_over_nospec"] = mean(spec, p) / mean("no_spec", p)
    headline["repeat_ratios"] = [
        {"step": sum(s["step"]) / sum(b["step"]), "generate": sum(s["generate"]) / sum(b["generate"]),
         **{f"{p}_speed_normalised": normalised_ratio([s[p]], [b[p]], [s[REFERENCE]], [b[REFERENCE]])
            for p in ("step", "generate")}}
        for s, b in zip(per_step[spec], per_step["no_spec"])]
    for p in ("step", "generate"):
        headline[f"{p}_ratio_ci95"] = list(ratio_ci95(series(spec, p), series("no_spec", p)))
        headline[f"{p}_ratio_speed_normalised"] = normalised_ratio(
            series(spec, p), series("no_spec", p), series(spec, REFERENCE), series("no_spec", REFERENCE))
        headline[f"{p}_ratio_speed_normalised_ci95"] = list(ratio_ci95(
            series(spec, p), series("no_spec", p), spec_ref=series(spec, REFERENCE),
            base_ref=series("no_spec", REFERENCE)))
    return headline


def print_headline(h: dict) -> None:
    if h["spec_setup"] is None:
        return
    print(f"{h['spec_setup']} over no_spec: step {h['step_ratio_spec_over_nospec']:.3f} "
          f"(95% CI {h['step_ratio_ci95'][0]:.3f}-{h['step_ratio_ci95'][1]:.3f}), "
          f"generate {h['generate_ratio_spec_over_nospec']:.3f} "
          f"(95% CI {h['generate_ratio_ci95'][0]:.3f}-{h['generate_ratio_ci95'][1]:.3f})")
    print(f"  per second of {REFERENCE} (the run's speed divided out): step "
          f"{h['step_ratio_speed_normalised']:.3f} (95% CI "
          f"{h['step_ratio_speed_normalised_ci95'][0]:.3f}-{h['step_ratio_speed_normalised_ci95'][1]:.3f}), "
          f"generate {h['generate_ratio_speed_normalised']:.3f} (95% CI "
          f"{h['generate_ratio_speed_normalised_ci95'][0]:.3f}-"
          f"{h['generate_ratio_speed_normalised_ci95'][1]:.3f})")
    if len(h["repeat_ratios"]) > 1:
        print("  per repeat: " + "; ".join(", ".join(f"{k} {v:.3f}" for k, v in r.items())
                                          for r in h["repeat_ratios"]))


def other_ratios(per_step: dict[str, list[dict]], headline: dict) -> dict:
    """headline_ratios of every other spec set-up measured, over the same no_spec runs."""
    return {name: headline_ratios(per_step, name) for name in HEADLINE_SETUPS
            if name in per_step and name != headline["spec_setup"]}


def pool_results(docs: list[tuple[str, dict]]) -> dict:
    """Several earlier invocations' JSON (`--json` output; (name, document) pairs) as one: their repeats
    side by side, as if one invocation had run them all. They must agree on `steps`, `skip` and the
    set-ups: a run's steps after the warm-up are not interchangeable with another length's. Raises
    ValueError naming the first file that differs."""
    if not docs:
        raise ValueError("--pool needs at least one JSON file written by step_time.py --json")
    first_name, first = docs[0]
    for name, doc in docs:
        missing = [k for k in ("steps", "skip", "per_step", "rows") if k not in doc]
        if missing:
            raise ValueError(f"--pool {name}: not a step_time.py --json output (no {missing})")
        for key in ("steps", "skip"):
            if doc[key] != first[key]:
                raise ValueError(f"--pool {name}: {key}={doc[key]} but {first_name} has {key}={first[key]}; "
                                 f"pool invocations of the same --steps and --skip only")
        if sorted(doc["per_step"]) != sorted(first["per_step"]):
            raise ValueError(f"--pool {name}: set-ups {sorted(doc['per_step'])} but {first_name} has "
                             f"{sorted(first['per_step'])}; pool invocations of the same --setups only")
        if "no_spec" not in doc["per_step"]:
            raise ValueError(f"--pool {name}: no no_spec runs (the baseline of every ratio)")
        rowless = sorted(set(doc["per_step"]) - {r.get("setup") for r in doc["rows"]})
        if rowless:
            raise ValueError(f"--pool {name}: no row for set-ups {rowless} (its rows and per-step times disagree)")
        lacking = sorted({p for runs in doc["per_step"].values() for run in runs for p in (*PHASES, REFERENCE)
                          if p not in run})
        if lacking:
            raise ValueError(f"--pool {name}: its per-step times lack {lacking} (written by an older step_time.py)")
    per_step = {s: [run for _, doc in docs for run in doc["per_step"][s]] for s in first["per_step"]}
    rows = []
    for setup in first["per_step"]:
        # each file's row is a mean over its runs' steps: weigh it by how many steps it saw
        parts = [(next(r for r in doc["rows"] if r["setup"] == setup), sum(len(run["step"]) for run in
                                                                            doc["per_step"][setup]))
                 for _, doc in docs]
        n = sum(w for _, w in parts)
        row = {"setup": setup}
        for key in (*(f"{p}_s" for p in PHASES), *ROW_MEANS):
            vals = [(r.get(key), w) for r, w in parts]
            row[key] = None if any(v is None for v, _ in vals) else sum(v * w for v, w in vals) / n
        rows.append(row)
    headline = headline_ratios(per_step)
    return {"steps": first["steps"], "skip": first["skip"], "repeats": len(per_step["no_spec"]),
            "pooled_from": [name for name, _ in docs], **headline, "other_setups": other_ratios(per_step, headline),
            "rows": with_ratios_to_no_spec(rows),
            "per_step": per_step}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="steps excluded from the means (the head is still untrained)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every set-up this many times, alternating their order; means over all runs")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma list of {list(SETUPS)} (must include no_spec)")
    ap.add_argument("--keep-runs", type=Path, default=None,
                    help="keep every run's directory (metrics.jsonl, config) under this folder instead of a temporary one")
    ap.add_argument("--pool", type=Path, nargs="+", default=None, metavar="JSON",
                    help="run nothing: report the repeats of these earlier --json outputs (same --steps, --skip and "
                         "--setups) together, with their intervals")
    ap.add_argument("--quick", action="store_true", help=f"smoke size {QUICK} with overrides {QUICK_OVERRIDES}")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every set-up")
    a = ap.parse_args(argv)
    if a.pool:
        run_flags = {"--steps": a.steps != ap.get_default("steps"), "--skip": a.skip != ap.get_default("skip"),
                     "--repeats": a.repeats != ap.get_default("repeats"),
                     "--setups": a.setups != ap.get_default("setups"), "--keep-runs": a.keep_runs is not None,
                     "--quick": a.quick, "overrides": bool(a.overrides)}
        given = [flag for flag, set_ in run_flags.items() if set_]
        if given:
            ap.error(f"--pool runs nothing, so {given} would be ignored; pool with --json OUT only "
                     "(the files' own --steps, --skip and --setups apply)")
        docs = []
        for path in a.pool:
            try:
                docs.append((str(path), json.loads(path.read_text())))
            except (OSError, json.JSONDecodeError) as err:
                ap.error(f"--pool {path}: cannot read it as JSON ({err})")
        try:
            pooled = pool_results(docs)
        except ValueError as err:
            ap.error(str(err))
        print(f"pooled {pooled['repeats']} repeats of {pooled['steps']} steps from {len(docs)} file(s)")
        print_rows(pooled["rows"])
        print_headline(pooled)
        for other in pooled["other_setups"].values():
            print_headline(other)
        if a.json:
            a.json.write_text(json.dumps(pooled, indent=2))
        return 0
    if a.quick:
        ap.set_defaults(**QUICK)
        a = ap.parse_args(argv)
        a.overrides = [*QUICK_OVERRIDES, *a.overrides]
    if a.steps <= a.skip:
        ap.error(f"--steps={a.steps} must be greater than --skip={a.skip}")
    setups = [x for x in a.setups.split(",") if x]
    unknown = sorted(set(setups) - set(SETUPS))
    if unknown or "no_spec" not in setups:
        ap.error(f"--setups={a.setups!r}: unknown {unknown}; allowed: {list(SETUPS)}, and no_spec (the baseline "
                 "of the ratios) must be one of them")
    if a.repeats < 1:
        ap.error(f"--repeats={a.repeats} must be >= 1")
    runs: dict[str, list[list[dict]]] = {name: [] for name in setups}
    with tempfile.TemporaryDirectory(prefix="step_time_") as tmp:
        tmp = a.keep_runs or tmp
        for rep in range(a.repeats):   # alternate the order (A B, B A, ...): drift of a busy machine cancels
            for name in (setups if rep % 2 == 0 else setups[::-1]):
                runs[name].append(run_setup(name, SETUPS[name], a.steps, Path(tmp) / f"rep{rep}", a.overrides))
    rows = setup_rows({name: summarize([row for run in rs for row in run], a.skip) for name, rs in runs.items()})
    print_rows(rows)
    per_step = {name: [{p: step_times(run, a.skip, p) for p in (*PHASES, REFERENCE)} for run in rs]
                for name, rs in runs.items()}
    headline = headline_ratios(per_step)
    others = other_ratios(per_step, headline)
    print_headline(headline)
    for other in others.values():
        print_headline(other)
    if a.json:
        a.json.write_text(json.dumps({"steps": a.steps, "skip": a.skip, "repeats": a.repeats, **headline,
                                      "other_setups": others, "rows": rows, "per_step": per_step}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
