"""benchmarks/step_time.py's per-set-up summary on hand-written metric rows: each phase column is that
phase's time, never a metric of the same name (the reward phase's time vs the mean reward)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("step_time", Path(__file__).resolve().parents[2] / "benchmarks" / "step_time.py")
step_time = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_time)


def _row(n, **timing):
    return {"step": n, "reward/mean": 0.25 * n, **{f"timing/{p}_s": v for p, v in timing.items()}}


def test_phases_are_times_and_the_reward_is_kept_apart():
    rows = [_row(1, generate=9.0, reward=9.0, step=9.0),   # skipped
            _row(2, generate=1.0, reward=0.5, old_logprobs=0.1, train=0.3, sync=0.05, step=2.0),
            _row(3, generate=3.0, reward=1.5, old_logprobs=0.3, train=0.5, sync=0.15, step=6.0)]
    out = step_time.summarize(rows, skip=1)
    assert out["generate"] == pytest.approx(2.0) and out["reward"] == pytest.approx(1.0)
    assert out["train"] == pytest.approx(0.4) and out["step"] == pytest.approx(4.0)
    assert out["reward_mean"] == pytest.approx(0.625)
    assert out["k_mean"] is None and out["head_trained_share"] is None and out["head_cost_s"] is None


def test_the_heads_cost_is_spread_over_every_measured_step_of_an_auto_run():
    # the idle head trains in bursts: one step of the three measured trained it (0.3 s with its push)
    rows = [_row(1, step=9.0) | {"train/head_trained": 1.0, "train/head_cost_s": 5.0},   # skipped
            _row(2, step=2.0) | {"train/head_trained": 0.0},
            _row(3, step=2.0) | {"train/head_trained": 1.0, "train/head_cost_s": 0.3},
            _row(4, step=2.0) | {"train/head_trained": 0.0}]
    out = step_time.summarize(rows, skip=1)
    assert out["head_trained_share"] == pytest.approx(1 / 3) and out["head_cost_s"] == pytest.approx(0.1)


def test_the_ratio_interval_collapses_when_every_step_has_the_same_ratio():
    base = [[1.0, 2.0, 3.0], [2.0, 2.0, 2.0]]
    spec = [[1.1 * t for t in run] for run in base]
    lo, hi = step_time.ratio_ci95(spec, base)
    assert lo == pytest.approx(1.1) and hi == pytest.approx(1.1)


def test_the_ratio_interval_sees_runs_that_differ_although_their_steps_do_not():
    # steady steps inside each run, but the spec run beside no_spec was 25% slower in one repeat and 25%
    # faster in the other: a step-level bootstrap alone would report a zero-width interval at 1.0
    base = [[1.0] * 8, [1.0] * 8]
    spec = [[1.25] * 8, [0.75] * 8]
    lo, hi = step_time.ratio_ci95(spec, base)
    assert lo == pytest.approx(0.75) and hi == pytest.approx(1.25)


def test_the_ratio_interval_narrows_as_repeats_agree():
    rng = __import__("random").Random(1)
    base = [[1.0 + 0.3 * rng.random() for _ in range(8)] for _ in range(6)]
    noisy = [[t * (1.0 + 0.4 * (i % 2 - 0.5)) for t in run] for i, run in enumerate(base)]
    steady = [[t * 1.0 for t in run] for run in base]
    wide, narrow = step_time.ratio_ci95(noisy, base), step_time.ratio_ci95(steady, base)
    assert narrow[0] <= 1.0 <= narrow[1] and wide[1] - wide[0] > 3 * (narrow[1] - narrow[0])


def test_the_ratio_interval_rejects_unpaired_runs():
    with pytest.raises(ValueError, match="same number"):
        step_time.ratio_ci95([[1.0]], [[1.0], [1.0]])
    with pytest.raises(ValueError, match="same number"):
        step_time.ratio_ci95([[1.0, 2.0]], [[1.0]])


def test_policy_work_leaves_out_what_training_the_head_added():
    row = {"timing/old_logprobs_s": 0.1, "timing/train_s": 0.5, "train/head_seconds": 0.2,
           "mtp/train_seconds": 0.05}   # the per-mini-batch mean: not what the step's head training cost
    assert step_time.policy_work(row) == pytest.approx(0.4)
    assert step_time.policy_work({"timing/old_logprobs_s": 0.1, "timing/train_s": 0.3}) == pytest.approx(0.4)
    assert step_time.step_times([{"step": 1, **row}, {"step": 2, **row}], 1, step_time.REFERENCE) == [pytest.approx(0.4)]


def test_the_normalised_ratio_divides_out_a_run_level_speed_factor():
    # the spec set-up truly costs 1.04x; each run also ran at its own machine speed (x1.5, x0.8, ...),
    # which slows the reference work alike: the raw ratios scatter, the normalised ones do not
    base_true, ref_true = [1.0, 1.2, 0.9, 1.1], [0.4, 0.5, 0.4, 0.45]
    speeds = [(1.5, 1.0), (0.8, 1.1), (1.0, 1.3), (1.2, 0.9)]   # (spec run, base run) per repeat
    spec = [[1.04 * t * sp for t in base_true] for sp, _ in speeds]
    base = [[t * sb for t in base_true] for _, sb in speeds]
    spec_ref = [[r * sp for r in ref_true] for sp, _ in speeds]
    base_ref = [[r * sb for r in ref_true] for _, sb in speeds]
    assert step_time.normalised_ratio(spec, base, spec_ref, base_ref) == pytest.approx(1.04)
    lo, hi = step_time.ratio_ci95(spec, base, spec_ref=spec_ref, base_ref=base_ref)
    assert 1.02 < lo <= 1.04 <= hi < 1.06   # what is left: steps whose time and reference differ in proportion
    raw_lo, raw_hi = step_time.ratio_ci95(spec, base)
    assert raw_hi - raw_lo > 0.3 and raw_hi - raw_lo > 10 * (hi - lo)


def test_the_normalised_interval_needs_both_references_shaped_like_the_runs():
    with pytest.raises(ValueError, match="both"):
        step_time.ratio_ci95([[1.0]], [[1.0]], spec_ref=[[1.0]])
    with pytest.raises(ValueError, match="shaped like"):
        step_time.ratio_ci95([[1.0, 2.0]], [[1.0, 2.0]], spec_ref=[[1.0]], base_ref=[[1.0, 1.0]])


def _doc(per_step_runs: dict, steps=4, skip=1):
    """A step_time --json document from per-step times: {setup: [[step times of run 1], ...]}; every other
    phase is a fixed share of the step, the reference work half of it."""
    per_step = {s: [{"step": run, "generate": [0.5 * t for t in run], "reward": [0.1 * t for t in run],
                     "old_logprobs": [0.1 * t for t in run], "train": [0.2 * t for t in run],
                     "sync": [0.1 * t for t in run], "policy_work": [0.3 * t for t in run]} for run in runs]
                for s, runs in per_step_runs.items()}
    rows = [{"setup": s, **{f"{p}_s": sum(sum(r[p]) for r in runs) / sum(len(r[p]) for r in runs)
                            for p in step_time.PHASES},
             "acceptance": 0.5 if s != "no_spec" else 0.0, "tokens_per_s": 100.0, "reward": 0.3,
             "k_mean": 1.0 if s != "no_spec" else None, "head_depths": None, "head_trained_share": None,
             "head_cost_s": None}
            for s, runs in per_step.items()]
    return {"steps": steps, "skip": skip, "rows": rows, "per_step": per_step}


def test_pooling_two_invocations_reports_what_one_invocation_of_all_their_repeats_would():
    a = {"spec_auto": [[1.2, 1.1, 1.3]], "no_spec": [[1.0, 1.0, 1.1]]}
    b = {"spec_auto": [[0.9, 1.0, 1.0], [1.5, 1.4, 1.6]], "no_spec": [[1.0, 0.9, 1.0], [1.2, 1.2, 1.3]]}
    both = {s: a[s] + b[s] for s in a}
    pooled = step_time.pool_results([("a.json", _doc(a)), ("b.json", _doc(b))])
    one = step_time.headline_ratios(_doc(both)["per_step"])
    assert pooled["repeats"] == 3 and pooled["pooled_from"] == ["a.json", "b.json"]
    for key in ("step_ratio_spec_over_nospec", "generate_ratio_spec_over_nospec", "step_ratio_ci95",
                "step_ratio_speed_normalised", "step_ratio_speed_normalised_ci95", "repeat_ratios"):
        assert pooled[key] == one[key], key   # the same times in the same order: the same bootstrap draws
    spec_steps = [t for run in both["spec_auto"] for t in run]
    assert pooled["step_ratio_spec_over_nospec"] == pytest.approx(
        sum(spec_steps) / sum(t for run in both["no_spec"] for t in run))
    # the rows are step-weighted means: b saw twice a's steps
    row = next(r for r in pooled["rows"] if r["setup"] == "spec_auto")
    assert row["step_s"] == pytest.approx(sum(spec_steps) / len(spec_steps))
    assert row["k_mean"] == pytest.approx(1.0) and row["head_depths"] is None
    assert row["step_ratio_vs_no_spec"] == pytest.approx(pooled["step_ratio_spec_over_nospec"])


@pytest.mark.parametrize("change, match", [
    ({"steps": 20}, "b.json: steps=20 but a.json has steps=4"),
    ({"skip": 2}, "b.json: skip=2 but a.json has skip=1"),
])
def test_pooling_refuses_runs_of_another_length(change, match):
    runs = {"spec_auto": [[1.0, 1.0, 1.0]], "no_spec": [[1.0, 1.0, 1.0]]}
    with pytest.raises(ValueError, match=match):
        step_time.pool_results([("a.json", _doc(runs)), ("b.json", {**_doc(runs), **change})])


def test_pooling_refuses_other_setups_and_files_that_are_not_step_time_output():
    runs = {"spec_auto": [[1.0, 1.0]], "no_spec": [[1.0, 1.0]]}
    other = {"spec_mtp_train": [[1.0, 1.0]], "no_spec": [[1.0, 1.0]]}
    with pytest.raises(ValueError, match="b.json: set-ups"):
        step_time.pool_results([("a.json", _doc(runs)), ("b.json", _doc(other))])
    with pytest.raises(ValueError, match=r"c.json: not a step_time.py --json output \(no \['per_step', 'rows'\]\)"):
        step_time.pool_results([("c.json", {"steps": 4, "skip": 1})])
    old = _doc(runs)
    for run in old["per_step"]["no_spec"]:
        del run["policy_work"]
    with pytest.raises(ValueError, match=r"d.json: its per-step times lack \['policy_work'\]"):
        step_time.pool_results([("d.json", old)])
    with pytest.raises(ValueError, match="e.json: no no_spec runs"):
        step_time.pool_results([("e.json", _doc({"spec_auto": [[1.0, 1.0]]}))])
    rowless = _doc(runs)
    rowless["rows"] = [r for r in rowless["rows"] if r["setup"] != "spec_auto"]
    with pytest.raises(ValueError, match=r"f.json: no row for set-ups \['spec_auto'\]"):
        step_time.pool_results([("f.json", rowless)])


def test_the_pool_command_reads_files_and_writes_the_pooled_json(tmp_path, capsys):
    import json

    runs = {"spec_auto": [[1.1, 1.1, 1.1]], "no_spec": [[1.0, 1.0, 1.0]]}
    files = []
    for name in ("a.json", "b.json"):
        files.append(tmp_path / name)
        files[-1].write_text(json.dumps(_doc(runs)))
    out = tmp_path / "pooled.json"
    assert step_time.main(["--pool", *map(str, files), "--json", str(out)]) == 0
    pooled = json.loads(out.read_text())
    assert pooled["repeats"] == 2 and pooled["step_ratio_ci95"] == pytest.approx([1.1, 1.1])
    assert "pooled 2 repeats of 4 steps from 2 file(s)" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SystemExit):
        step_time.main(["--pool", str(tmp_path / "bad.json")])
    assert "--pool" in capsys.readouterr().err
    # flags that only a run uses are refused, not ignored
    with pytest.raises(SystemExit):
        step_time.main(["--steps", "30", "--repeats", "2", "--pool", *map(str, files)])
    assert "--pool runs nothing, so ['--steps', '--repeats'] would be ignored" in capsys.readouterr().err


def test_every_other_spec_setup_gets_its_own_ratios_over_the_same_no_spec_runs():
    runs = {"spec_auto": [[1.2, 1.1, 1.3], [1.0, 1.1, 1.0]], "spec_auto_no_explore": [[1.0, 1.0, 1.2], [0.9, 1.0, 1.0]],
            "no_spec": [[1.0, 1.0, 1.1], [1.0, 0.9, 1.0]]}
    per_step = _doc(runs)["per_step"]
    headline = step_time.headline_ratios(per_step)
    others = step_time.other_ratios(per_step, headline)
    assert headline["spec_setup"] == "spec_auto" and list(others) == ["spec_auto_no_explore"]
    lean = others["spec_auto_no_explore"]
    alone = step_time.headline_ratios({s: per_step[s] for s in ("spec_auto_no_explore", "no_spec")})
    assert lean == alone and lean["spec_setup"] == "spec_auto_no_explore"
    assert lean["step_ratio_spec_over_nospec"] == pytest.approx(6.1 / 6.0)
    pooled = step_time.pool_results([("a.json", _doc(runs))])
    assert pooled["other_setups"]["spec_auto_no_explore"]["step_ratio_spec_over_nospec"] == pytest.approx(6.1 / 6.0)
