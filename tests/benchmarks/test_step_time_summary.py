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
    assert out["k_mean"] is None and out["head_trained_share"] is None


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
