"""benchmarks/async_modes.py on hand-written metric rows: the measured steps, the engines' idle time, the ratios
to sync with the same MTP setting, the long-tail prompt file, and the arguments it refuses before any run."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import async_modes  # noqa: E402  (benchmarks/ is not a package)


def _row(n, **timing):
    return {"step": n, **{f"timing/{p}_s": v for p, v in timing.items()}}


def test_every_eighth_prompt_carries_the_filler_and_keeps_its_answer():
    from skyrl_mtp.data.arithmetic_task import ArithmeticTaskConfig, generate_rows

    plain = generate_rows(ArithmeticTaskConfig(digits=1, num_train=24, num_test=0, seed=0))["train"]
    rows = async_modes.long_tail_rows(n=24)
    tails = [i for i, r in enumerate(rows) if r["extra_info"].get("long_tail")]
    assert tails == [0, 8, 16]
    for i, (row, ref) in enumerate(zip(rows, plain)):
        question = ref["prompt"][0]["content"]
        want = question + async_modes.TAIL_FILLER if i in tails else question
        assert row["prompt"][0]["content"] == want
        assert row["reward_model"] == ref["reward_model"]


def test_the_long_tail_file_makes_a_run_the_config_accepts(tmp_path):
    overrides = async_modes.write_long_tail(tmp_path / "long_tail.jsonl")
    assert (tmp_path / "long_tail.jsonl").read_text().count("\n") == async_modes.TAIL_ROWS
    args = async_modes.cli_overrides(tmp_path / "run", async_modes.SETUPS["one_step_off"], 12, overrides)
    assert async_modes.refusal(args) is None
    why = async_modes.refusal([*args, "trainer.async_rl.mode=sometimes"])
    assert "trainer.async_rl.mode" in why and "sometimes" in why


def test_the_measured_steps_leave_out_the_first_and_the_last():
    rows = [_row(n, step=float(n)) for n in range(1, 7)]
    assert [r["step"] for r in async_modes.measured(rows, skip=2, drop_last=1)] == [3, 4, 5]
    assert [r["step"] for r in async_modes.measured(rows, skip=0, drop_last=0)] == [1, 2, 3, 4, 5, 6]


def test_engines_idle_is_the_loops_own_in_the_async_modes_and_for_sync_the_step_less_its_generation():
    sync = _row(3, generate=0.8, reward=0.2, train=0.7, step=2.0)
    logged = _row(3, train=0.7, wait_rollout=0.1, **{"background/generate": 0.5, "engines_idle": 0.3}, step=1.0)
    assert async_modes.phase_seconds(sync, "engines_idle") == pytest.approx(1.0)
    assert async_modes.phase_seconds(logged, "engines_idle") == pytest.approx(0.3)
    assert async_modes.phase_seconds(sync, "wait_rollout") == 0.0


def test_the_timeline_lists_the_phases_logged_in_the_loops_order_then_every_other_one():
    runs = [[_row(1, generate=1.0, eval=2.0, step=3.0)], [_row(1, pause=0.1, checkpoint=0.5, step=0.5)]]
    assert async_modes.timeline_phases(runs) == ["generate", "pause", "engines_idle", "step", "checkpoint", "eval"]


def test_each_ratio_is_over_sync_with_the_same_mtp_setting():
    phases = ["generate", "engines_idle", "step"]
    base = [[1.0, 2.0, 1.0], [2.0, 2.0, 2.0]]   # two repeats of three measured steps

    def runs(scale):
        return [[_row(i + 1, generate=0.5 * t * scale, step=t * scale) for i, t in enumerate(run)] for run in base]

    summaries = {"sync": async_modes.summarize_setup(runs(1.0), phases),
                 "one_step_off": async_modes.summarize_setup(runs(0.8), phases),
                 "sync_no_mtp": async_modes.summarize_setup(runs(2.0), phases),
                 "one_step_off_no_mtp": async_modes.summarize_setup(runs(1.0), phases)}
    rows = async_modes.with_ratios({n: s[0] for n, s in summaries.items()}, {n: s[1] for n, s in summaries.items()})
    assert rows["sync"]["steps_per_s"] == pytest.approx(6 / 10)
    assert rows["sync"]["timeline"]["generate"] == pytest.approx(0.5 * 10 / 6)
    assert rows["one_step_off"]["baseline"] == "sync" and rows["one_step_off_no_mtp"]["baseline"] == "sync_no_mtp"
    assert rows["one_step_off"]["ratio_vs_sync"] == pytest.approx(1.25)
    assert rows["one_step_off_no_mtp"]["ratio_vs_sync"] == pytest.approx(2.0)
    assert rows["one_step_off"]["ratio_ci95"] == pytest.approx([1.25, 1.25])   # every step the same ratio
    assert rows["one_step_off"]["ratio_per_repeat"] == pytest.approx([1.25, 1.25])
    assert rows["sync"]["ratio_vs_sync"] == pytest.approx(1.0)
    assert rows["sync"]["acceptance"] is None and rows["sync"]["staleness"] is None   # not logged


def test_a_set_up_without_its_baseline_needs_none():
    rows = {"one_step_off": {"step_s": 1.0}}
    out = async_modes.with_ratios(rows, {"one_step_off": [{"step": [1.0]}]})
    assert out["one_step_off"]["ratio_vs_sync"] is None and out["one_step_off"]["ratio_ci95"] is None


@pytest.mark.parametrize("argv, words", [
    (["--setups", "one_step_off"], "without their sync baseline ['one_step_off']"),
    (["--setups", "sync,sometimes"], "unknown ['sometimes']"),
    (["--steps", "3", "--skip", "2"], "must leave a measured step"),
])
def test_bad_arguments_are_refused_before_any_run(argv, words, capsys):
    with pytest.raises(SystemExit) as err:
        async_modes.main(argv)
    assert err.value.code == 2 and words in capsys.readouterr().err
