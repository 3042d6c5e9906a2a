"""scripts/plot_reward_curves.py on hand-written run directories: the eval reward it reports per run and over the
runs, the PNG it writes, and the run directories and labels it refuses."""

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "plot_reward_curves", Path(__file__).resolve().parents[2] / "scripts" / "plot_reward_curves.py")
plot_reward_curves = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_reward_curves)


def _run(root: Path, name: str, evals: dict[int, float], steps: int = 30) -> Path:
    run = root / name
    run.mkdir(parents=True)
    rows = [{"step": s, "reward/mean": 0.01 * s, **({"eval/reward/mean": evals[s]} if s in evals else {})}
            for s in range(1, steps + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_it_reports_each_runs_last_eval_and_the_range_and_writes_the_png(tmp_path, capsys):
    a = _run(tmp_path, "sync_seed1", {10: 0.25, 20: 0.5, 30: 0.625})
    b = _run(tmp_path, "one_step_off", {10: 0.3, 30: 0.5625})
    c = _run(tmp_path, "no_eval", {})
    out = tmp_path / "curves" / "curves.png"
    assert plot_reward_curves.main([str(a), str(b), str(c), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["sync_seed1", "eval", "reward", "0.6250", "at", "step", "30"]
    assert lines[1].split() == ["one_step_off", "eval", "reward", "0.5625", "at", "step", "30"]
    assert lines[2].split() == ["no_eval", "no", "eval", "reward", "logged"]
    assert lines[3].split() == ["range", "0.5625", "-", "0.6250", "over", "2", "run(s)"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_the_last_eval_is_the_latest_step_whatever_the_row_order():
    rows = [{"step": 40, "eval/reward/mean": 0.7}, {"step": 20, "eval/reward/mean": 0.9}, {"step": 41}]
    assert plot_reward_curves.last_eval(rows) == (40, 0.7)
    assert plot_reward_curves.last_eval([{"step": 1, "reward/mean": 0.5}]) is None


def test_labels_name_the_runs_and_must_match_them(tmp_path, capsys):
    a, b = _run(tmp_path / "x", "run", {30: 0.5}), _run(tmp_path / "y", "run", {30: 0.75})
    out = str(tmp_path / "c.png")
    with pytest.raises(SystemExit):   # both directories are called "run"
        plot_reward_curves.main([str(a), str(b), "--out", out])
    assert "repeat" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plot_reward_curves.main([str(a), str(b), "--out", out, "--labels", "only_one"])
    assert "1 labels for 2 run directories" in capsys.readouterr().err
    assert plot_reward_curves.main([str(a), str(b), "--out", out, "--labels", "sync_1,sync_2"]) == 0
    assert "sync_2  eval reward 0.7500 at step 30" in capsys.readouterr().out


def test_a_directory_without_metrics_is_named(tmp_path, capsys):
    assert plot_reward_curves.main([str(tmp_path / "missing"), "--out", str(tmp_path / "c.png")]) == 2
    assert str(tmp_path / "missing" / "metrics.jsonl") in capsys.readouterr().err
