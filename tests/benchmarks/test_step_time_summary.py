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
