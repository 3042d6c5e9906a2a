"""Pure parts of the RL loop: batch assembly, seeds, metric averaging, run directory, warm-start plumbing."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from skyrl_mtp.algorithms.train_batch import Rollout, build_train_batch
from skyrl_mtp.trainer.run_dir import COMPLETE_MARKER, RunDir, read_trainer_state
from skyrl_mtp.trainer.trainer import combine_round_metrics, mean_metrics, step_seed
from skyrl_mtp.trainer.warm_start import (
    SFTExample,
    WarmStartPlan,
    cache_key,
    sft_batches,
    write_hf_checkpoint,
)


def test_build_train_batch_layout_and_masks():
    rs = [Rollout([5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], "stop", response_loss_mask=[1, 0, 1]),
          Rollout([5], [4], [-1.0], "length")]
    b = build_train_batch(rs, torch.tensor([2.0, -1.0]), pad_id=0, response_masks=torch.tensor([1.0, 0.0]))
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 4, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert b["loss_mask"].tolist() == [[0, 0, 1, 0, 1], [0, 0, 0, 0, 0]]
    assert b["advantages"].tolist() == [[0, 0, 2, 0, 2], [0, 0, 0, 0, 0]]
    assert b["rollout_logprobs"][0].tolist() == pytest.approx([0, 0, -0.1, -0.2, -0.3])


def test_build_train_batch_rejects_mismatches():
    with pytest.raises(ValueError, match="advantages must have shape"):
        build_train_batch([Rollout([1], [2], [0.0], "stop")], torch.zeros(2), 0)
    with pytest.raises(ValueError, match="logprobs for 2 response tokens"):
        build_train_batch([Rollout([1], [2, 3], [0.0], "stop")], torch.zeros(1), 0)
    with pytest.raises(ValueError, match="empty prompt"):
        build_train_batch([Rollout([], [2], [0.0], "stop")], torch.zeros(1), 0)


def test_step_seed_is_deterministic_and_distinct():
    seeds = {step_seed(42, s, r) for s in range(50) for r in range(3)}
    assert len(seeds) == 150
    assert step_seed(42, 7, 1) == step_seed(42, 7, 1)
    assert all(0 <= s < 2**31 - 1 for s in seeds)


def test_mean_metrics_averages_over_parts_that_have_the_key():
    assert mean_metrics([{"a": 1.0, "b": 2.0}, {"a": 3.0}]) == {"a": 2.0, "b": 2.0}


def test_run_dir_commit_latest_and_prune(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.create(OmegaConf.create({"x": 1}))
    for step in (2, 4, 6):
        staging = rd.staging_dir(step)
        (staging / "payload").write_text(str(step))
        rd.commit(staging, step, {"step": step, "data": {"epoch": 0, "position": step}}, keep_last=2)
    assert rd.complete_steps() == [4, 6]
    assert read_trainer_state(rd.latest()) == {"step": 6, "data": {"epoch": 0, "position": 6}}
    # a crash mid-save leaves only a staging dir or an unmarked dir: never picked up by resume
    rd.staging_dir(8)
    (rd.checkpoints / "step_10").mkdir()
    assert rd.latest() == rd.step_dir(6)
    assert (rd.step_dir(6) / COMPLETE_MARKER).read_text() == "6"


def test_sft_batches_cycle_deterministically_and_mask_tool_tokens():
    ex = [SFTExample([1, 2], [3, 4, 5], [1, 0, 1]), SFTExample([1], [6])]
    plan = WarmStartPlan(steps=3, lr=1e-3, batch_size=2, seed=0, micro_batch_size=2)
    a, b = list(sft_batches(ex, plan, pad_id=0)), list(sft_batches(ex, plan, pad_id=0))
    assert len(a) == 3 and all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    rows = {tuple(r.tolist()): m.tolist() for bt in a for r, m in zip(bt["input_ids"], bt["loss_mask"])}
    assert rows[(1, 2, 3, 4, 5)] == [0, 0, 1, 0, 1]
    assert rows[(1, 6, 0, 0, 0)] == [0, 1, 0, 0, 0]
    assert "advantages" not in a[0] and "old_logprobs" not in a[0]


def test_write_hf_checkpoint_replaces_trunk_keeps_mtp(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"a": 1}))
    save_file({"model.norm.weight": torch.ones(2), "model.mtp_layers.0.x": torch.zeros(2)}, str(base / "model.safetensors"))
    out = tmp_path / "out"
    write_hf_checkpoint(out, base, {"model.norm.weight": torch.full((2,), 3.0)})
    w = load_file(str(out / "model.safetensors"))
    assert w["model.norm.weight"].tolist() == [3.0, 3.0] and w["model.mtp_layers.0.x"].tolist() == [0.0, 0.0]
    assert (out / "config.json").exists()
    with pytest.raises(ValueError, match="lacks"):
        write_hf_checkpoint(tmp_path / "bad", base, {"model.unknown": torch.ones(1)})


def test_warm_start_cache_key_depends_on_plan_and_data(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    ex = [SFTExample([1], [2])]
    p1 = WarmStartPlan(steps=3, lr=1e-3, batch_size=2, seed=0, micro_batch_size=2)
    p2 = WarmStartPlan(steps=4, lr=1e-3, batch_size=2, seed=0, micro_batch_size=2)
    assert cache_key(tmp_path, p1, ex) == cache_key(tmp_path, p1, list(ex))
    assert cache_key(tmp_path, p1, ex) != cache_key(tmp_path, p2, ex)
    assert cache_key(tmp_path, p1, ex) != cache_key(tmp_path, p1, [SFTExample([1], [3])])


def test_resume_never_refuses_to_overwrite_a_run(tmp_path):
    from skyrl_mtp.config import ConfigError, load_config

    run = tmp_path / "run"
    overrides = ["recipe=tiny_dapo", f"trainer.run_dir={run}", "trainer.resume=never"]
    load_config(overrides)  # empty: fine
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="trainer.run_dir.*resume=never"):
        load_config(overrides)   # at validation, before anything starts
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    load_config([*overrides[:2], "trainer.resume=auto"])   # continuing it is fine


@pytest.fixture(scope="module")
def tokenizer():
    from skyrl_mtp.models.tiny import build_tokenizer

    return build_tokenizer(512, 0)


def _rows_file(tmp_path, rows):
    p = tmp_path / "train.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


GOOD = {"prompt": [{"role": "user", "content": "What is 1+2?"}], "reward_model": {"ground_truth": "3"}}


def test_malformed_rows_are_a_clear_error_or_skipped_and_counted(tmp_path, tokenizer, capsys):
    from skyrl_mtp.config import ConfigError, load_config
    from skyrl_mtp.trainer.launch import load_examples
    from skyrl_mtp.trainer.run_plan import build_run_plan

    path = _rows_file(tmp_path, [GOOD, {"prompt": "not a list", "reward_model": {"ground_truth": "1"}}, GOOD])
    cfg = load_config(["recipe=tiny_dapo"])
    with pytest.raises(ConfigError, match=r"data.train_files\[0\].*row 1: field 'prompt'"):
        load_examples(build_run_plan(cfg), [path], tokenizer, "train")
    cfg = load_config(["recipe=tiny_dapo", "data.skip_malformed=true"])
    assert len(load_examples(build_run_plan(cfg), [path], tokenizer, "train")) == 2
    assert "skipped 1 malformed rows" in capsys.readouterr().err


def test_overlong_prompts_are_dropped_and_an_empty_result_is_an_error(tmp_path, tokenizer):
    from skyrl_mtp.config import ConfigError, load_config
    from skyrl_mtp.trainer.launch import load_examples
    from skyrl_mtp.trainer.run_plan import build_run_plan

    long = {**GOOD, "prompt": [{"role": "user", "content": "9 " * 200}]}
    path = _rows_file(tmp_path, [GOOD, long])
    cfg = load_config(["recipe=tiny_dapo"])
    assert len(load_examples(build_run_plan(cfg), [path], tokenizer, "train")) == 1
    with pytest.raises(ConfigError, match="no usable rows"):
        load_examples(build_run_plan(cfg), [_rows_file(tmp_path, [long])], tokenizer, "train")


def test_missing_data_file_fails_before_anything_starts(tmp_path, capsys):
    from skyrl_mtp.main import main

    missing = tmp_path / "nope.parquet"
    assert main(["recipe=tiny_dapo", "data.synthetic=null", f"data.train_files=[{missing}]"]) == 2
    assert f"data.train_files[0]='{missing}' is invalid: path does not exist" in capsys.readouterr().err


def test_engine_config_carries_the_sampling_switches_from_the_generator_config(tmp_path):
    from skyrl_mtp.config import load_config
    from skyrl_mtp.trainer.run_plan import engine_config

    default = engine_config(load_config(["recipe=tiny_dapo"]), tmp_path)
    assert default.draft_invariant_sampling is True and default.cpu_sampling_fix is True
    assert default.num_speculative_tokens == 2
    off = engine_config(load_config(["recipe=tiny_dapo", "generator.draft_invariant_sampling=false",
                                     "generator.cpu_sampling_fix=false"]), tmp_path)
    assert off.draft_invariant_sampling is False and off.cpu_sampling_fix is False


def test_tiny_model_config_is_a_subset_of_the_model_spec():
    import dataclasses

    from skyrl_mtp.config.schema import TinyModelConfig
    from skyrl_mtp.models.tiny import TinyModelSpec

    spec_defaults = {f.name: f.default for f in dataclasses.fields(TinyModelSpec)}
    for f in dataclasses.fields(TinyModelConfig):
        if f.name != "cache_dir":
            assert f.name in spec_defaults, f"model.tiny.{f.name} is not a TinyModelSpec field"
            assert f.default == spec_defaults[f.name], f"model.tiny.{f.name} default differs from TinyModelSpec's"


def test_resolve_model_builds_the_spec_from_model_tiny(tmp_path, monkeypatch):
    from skyrl_mtp.config import load_config
    from skyrl_mtp.trainer import launch
    from skyrl_mtp.trainer.run_plan import build_run_plan

    seen = {}
    monkeypatch.setattr("skyrl_mtp.models.tiny.cached_tiny_checkpoint",
                        lambda root, spec: seen.update(root=root, spec=spec) or tmp_path / "ckpt")
    cfg = load_config(["recipe=tiny_dapo", "model.tiny.hidden=256", "model.tiny.seed=3"])
    assert launch.resolve_model(build_run_plan(cfg), tmp_path) == tmp_path / "ckpt"
    assert seen["spec"].hidden == 256 and seen["spec"].seed == 3 and seen["spec"].layers == 2
    assert seen["root"] == tmp_path / "models"


def test_step_timer_phases_are_exclusive_and_add_up():
    from skyrl_mtp.trainer.step_timer import StepTimer

    ticks = iter([0.0, 1.0, 3.0, 4.5, 5.0, 6.0, 10.0, 12.0])
    timer = StepTimer(clock=lambda: next(ticks))
    with timer.phase("generate"):          # 0.0
        with timer.phase("reward"):        # 1.0 .. 3.0
            pass
        with timer.phase("reward"):        # 4.5 .. 5.0
            pass
    with timer.phase("train"):             # 10.0 .. 12.0 (generate closed at 6.0)
        pass
    # generate: 0-1 and 3-4.5 and 5-6 = 3.5; reward: 2 + 0.5 = 2.5; train: 12 - 10 = 2
    m = timer.metrics()
    assert m["timing/generate_s"] == 3.5 and m["timing/reward_s"] == 2.5 and m["timing/train_s"] == 2.0
    assert m["timing/step_s"] == 8.0


def test_policy_group_wants_one_option_set_per_rank():
    from skyrl_mtp.trainer.policy_group import PolicyGroup

    with pytest.raises(ValueError, match="per_rank_options has 1 entries for world_size=2"):
        PolicyGroup.create(None, "/nowhere", 2, 1, 1, 1, 2, per_rank_options=[{}])


def test_round_metrics_sum_counts_max_maxima_and_average_the_rest():
    from skyrl_mtp.envs.multi_turn import MAX_METRICS, SUMMED_METRICS

    rounds = [{"multi_turn/search_failures": 2.0, "multi_turn/retriever_latency_max_s": 0.5,
               "multi_turn/num_turns_mean": 1.0},
              {"multi_turn/search_failures": 3.0, "multi_turn/retriever_latency_max_s": 0.2,
               "multi_turn/num_turns_mean": 2.0}]
    m = combine_round_metrics(rounds, SUMMED_METRICS, MAX_METRICS)
    assert m == {"multi_turn/search_failures": 5.0, "multi_turn/retriever_latency_max_s": 0.5,
                 "multi_turn/num_turns_mean": 1.5}
