"""Tracker files and resume policy, PNG plots with content, and the summary table."""

import io
import json

import pytest

from skyrl_mtp.tracking.plots import write_plots
from skyrl_mtp.tracking.summary import format_summary, summarize
from skyrl_mtp.tracking.tracker import Tracker, read_metrics


def _run(tmp_path, steps, **kw):
    s = io.StringIO()
    t = Tracker(tmp_path, ("console", "jsonl"), stream=s, **kw)
    for i in steps:
        t.log({"reward/mean": 0.1 * i, "policy/loss": 1.0 / (i + 1), "mtp/loss": 2.0 - 0.1 * i,
               "spec/acceptance_rate_pos_0": 0.5 + 0.01 * i, "spec/mean_acceptance_length": 1.0 + 0.1 * i}, step=i)
    t.close()
    return s.getvalue()


def test_tracker_jsonl_console_and_resume(tmp_path):
    out = _run(tmp_path, range(5))
    assert "[step 4]" in out and "reward/mean=0.4" in out
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "rew')  # torn write from a crash
    _run(tmp_path, [3, 4, 5], resume_step=2)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="tensorboard"):
        Tracker(tmp_path, ("tensorboard",))


def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = Tracker(tmp_path, ("jsonl", "wandb"))
    t.log({"x": 1.0}, step=0)
    t.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["x"] == 1.0


def test_plots_and_summary(tmp_path):
    _run(tmp_path, range(4))
    paths = write_plots(tmp_path / "metrics.jsonl", tmp_path / "plots")
    assert {p.name for p in paths} == {"reward.png", "acceptance_per_position.png",
                                      "mean_acceptance_length.png", "losses.png"}
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    s = summarize(tmp_path / "metrics.jsonl")
    assert s["reward/mean"]["first"] == 0.0 and s["reward/mean"]["best"] == pytest.approx(0.3)
    assert s["policy/loss"]["best"] == 0.25 and s["policy/loss"]["best_step"] == 3
    table = format_summary(s)
    assert "reward/mean" in table and "spec/mean_acceptance_length" in table
