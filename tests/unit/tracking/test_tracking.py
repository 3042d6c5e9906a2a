"""Tracker files and resume policy, PNG plots with content, and the summary table."""

import io
import json
import struct

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
    assert out.splitlines() == [f"step {i}  reward {0.1 * i:.3f}" for i in range(5)]   # one short line per step
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
    assert "10%" not in table   # 4 points: a tenth is the first / last value again, so those columns are left out
    # the policy loss and the draft loss each get an axis of their own: losses.png is two panels tall
    size = {p.name: struct.unpack(">II", p.read_bytes()[16:24]) for p in paths}
    assert size["losses.png"][1] > size["reward.png"][1]


def test_moving_average_and_summary_tenths(tmp_path):
    from skyrl_mtp.tracking.plots import moving_average

    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0], 10) == [2.0]
    _run(tmp_path, range(30))                       # 30 points: smoothed plot, tenths of 3 points
    paths = write_plots(tmp_path / "metrics.jsonl", tmp_path / "plots")
    assert len(paths) == 4
    s = summarize(tmp_path / "metrics.jsonl")
    assert s["reward/mean"]["head_mean"] == pytest.approx(0.1)          # mean of 0.0, 0.1, 0.2
    assert s["reward/mean"]["tail_mean"] == pytest.approx(2.8)          # mean of 2.7, 2.8, 2.9
    assert "last 10%" in format_summary(s)


def _fake_run(root, *, trunk_value=1.0, mtp_value=1.0, acceptance=0.5, reward=0.25, mtp_name="model.mtp_layers.0.w"):
    import torch
    from safetensors.torch import save_file

    root.mkdir()
    rows = [{"step": s, "reward/mean": reward, "policy/loss": 0.1 * s, "mtp/loss": mtp_value,
             "rollout/train/draft_acceptance_rate": acceptance, "timing/step_s": 0.1 * s + mtp_value}
            for s in (1, 2)]
    (root / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ck = root / "checkpoints" / "step_2"
    (ck / "hf").mkdir(parents=True)
    (ck / "COMPLETE").write_text("")
    save_file({"model.layers.0.w": torch.full((2, 2), trunk_value),
               mtp_name: torch.full((2,), mtp_value)}, str(ck / "hf" / "model.safetensors"))
    return root


def test_compare_policy_runs_ignores_the_head_and_catches_the_trunk(tmp_path):
    from skyrl_mtp.tracking.compare import compare_policy_runs

    base = _fake_run(tmp_path / "a")
    head_only = _fake_run(tmp_path / "b", mtp_value=2.0, acceptance=0.9)
    problems, summary = compare_policy_runs(base, head_only)
    assert problems == [] and summary["trunk_tensors_compared"] == 1 and summary["checkpoint"] == "step_2"
    # two builds of the code compared on the same recipe: the head's metrics must agree too (timings never)
    problems, _ = compare_policy_runs(base, head_only, draft_metrics=True)
    assert sorted(p.split(" ")[2].rstrip(":") for p in problems) == ["mtp/loss", "mtp/loss",
        "rollout/train/draft_acceptance_rate", "rollout/train/draft_acceptance_rate"]
    assert compare_policy_runs(base, _fake_run(tmp_path / "e"), draft_metrics=True)[0] == []
    trunk = _fake_run(tmp_path / "c", trunk_value=1.0 + 2**-20)
    problems, _ = compare_policy_runs(base, trunk)
    assert problems == ["step_2: model.layers.0.w differs"]
    reward = _fake_run(tmp_path / "d", reward=0.5)
    problems, _ = compare_policy_runs(base, reward)
    assert len(problems) == 2 and all("reward/mean" in p for p in problems)
    # Qwen3.5's MTP tensors live under "mtp.": the head is still told apart from the trunk
    qa = _fake_run(tmp_path / "qa", mtp_name="mtp.layers.0.w")
    qb = _fake_run(tmp_path / "qb", mtp_name="mtp.layers.0.w", mtp_value=2.0)
    problems, summary = compare_policy_runs(qa, qb)
    assert problems == [] and summary["trunk_tensors_compared"] == 1


def test_wandb_mode_comes_from_the_config_not_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")   # would try to reach the server if it were read
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = Tracker(tmp_path, ("jsonl", "wandb"), wandb_mode="disabled")
    assert t._wandb is not None and t._wandb.settings.mode == "disabled"
    t.close()
    with pytest.raises(ValueError, match="wandb_mode='sometimes'"):
        Tracker(tmp_path, ("jsonl",), wandb_mode="sometimes")


def test_non_finite_values_are_kept_in_metrics_jsonl(tmp_path):
    t = Tracker(tmp_path, ("jsonl",))
    t.log({"policy/loss": float("nan"), "mtp/grad_norm": float("inf"), "reward/mean": 0.5}, step=3)
    t.close()
    row = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert row["policy/loss"] == "nan" and row["mtp/grad_norm"] == "inf" and row["reward/mean"] == 0.5
    assert row["nonfinite_metrics"] == ["mtp/grad_norm", "policy/loss"]


def test_the_console_line_shows_acceptance_only_where_the_engines_drafted():
    from skyrl_mtp.tracking.console import format_step_line

    row = {"reward/mean": 0.5, "rollout/train/draft_acceptance_rate": 0.0, "rollout/train/mean_acceptance_length": 1.0,
           "rollout/train/tokens_per_s": 100.0}
    assert format_step_line(1, {**row, "rollout/train/num_drafts": 0.0}) == "step 1  reward 0.500  100 tok/s"
    assert format_step_line(1, {**row, "rollout/train/num_drafts": 12.0}) == \
        "step 1  reward 0.500  accept 0.00  len 1.00  100 tok/s"
