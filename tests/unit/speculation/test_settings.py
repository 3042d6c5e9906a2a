"""Auto k's keys reach the engines: the run config's keys become EngineConfig fields, and those one serialised
entry of vLLM's additional_config that the engine core's scheduler reads; bad values are named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from skyrl_mtp.config.loader import load_config
from skyrl_mtp.errors import ConfigError
from skyrl_mtp.rollout.config import EngineConfig
from skyrl_mtp.speculation.settings import (
    ADDITIONAL_CONFIG_KEY,
    SCHEDULER_CLS,
    AdaptiveSpeculationError,
    SpeculationSettings,
    dynamic_schedule,
)
from skyrl_mtp.trainer.run_plan import engine_config, loop_config, train_depths


def test_auto_reaches_the_engine_config_and_vllms_config_with_its_settings(tmp_path):
    cfg = load_config(["recipe=tiny_dapo", "trainer.mtp.num_speculative_tokens=auto",
                       "trainer.mtp.max_speculative_tokens=4", "trainer.mtp.explore_budget=0.05",
                       f"trainer.mtp.policy_trace_dir={tmp_path}/tr"])
    ec = engine_config(cfg, "/tmp/model")
    assert ec.adaptive_speculation is True and ec.num_speculative_tokens == 4
    assert ec.speculative_config["num_speculative_tokens_per_batch_size"] == dynamic_schedule(4, ec.max_num_seqs)
    managed = ec.managed_engine_kwargs("m.C")
    assert managed["scheduler_cls"] == SCHEDULER_CLS and managed["async_scheduling"] is False
    vllm_config = SimpleNamespace(additional_config=managed["additional_config"])   # what the engine core gets
    assert SpeculationSettings.from_vllm_config(vllm_config) == SpeculationSettings(0.05, f"{tmp_path}/tr")
    assert train_depths(cfg) == 4    # depth-aware training up to the maximum k
    fixed = engine_config(load_config(["recipe=tiny_dapo", "trainer.mtp.num_speculative_tokens=2"]), "/tmp/model")
    assert fixed.adaptive_speculation is False and "num_speculative_tokens_per_batch_size" not in fixed.speculative_config
    kwargs = fixed.managed_engine_kwargs("m.C")
    assert kwargs["scheduler_cls"] is None and kwargs["async_scheduling"] is None and kwargs["additional_config"] == {}


def test_the_users_additional_config_is_kept_and_its_speculation_entry_is_the_projects():
    ec = EngineConfig(model_path="/m", num_speculative_tokens=3, adaptive_speculation=True,
                      engine_kwargs={"additional_config": {"gdn_prefill_backend": "triton"}})
    extra = ec.managed_engine_kwargs("m.C")["additional_config"]
    assert extra["gdn_prefill_backend"] == "triton" and extra[ADDITIONAL_CONFIG_KEY]["explore_budget"] == 0.02
    with pytest.raises(ValueError, match="additional_config that is a dict without skyrl_mtp's own entries"):
        EngineConfig(model_path="/m", engine_kwargs={"additional_config": {ADDITIONAL_CONFIG_KEY: {}}})


def test_a_scheduler_built_without_its_settings_or_with_bad_ones_fails_naming_them():
    with pytest.raises(AdaptiveSpeculationError, match=f"no '{ADDITIONAL_CONFIG_KEY}' entry"):
        SpeculationSettings.from_vllm_config(SimpleNamespace(additional_config={}))
    with pytest.raises(ValueError, match="explore_budget=0.9 is invalid"):
        SpeculationSettings.from_vllm_config(SimpleNamespace(
            additional_config={ADDITIONAL_CONFIG_KEY: {"explore_budget": 0.9, "trace_dir": None}}))
    with pytest.raises(ValueError, match="trace_dir=' ' is invalid"):
        SpeculationSettings(trace_dir=" ")


@pytest.mark.parametrize("overrides, named", [
    (["trainer.mtp.num_speculative_tokens=banana"], "trainer.mtp.num_speculative_tokens='banana'"),
    (["trainer.mtp.num_speculative_tokens=auto", "trainer.mtp.max_speculative_tokens=0"],
     "trainer.mtp.max_speculative_tokens=0"),
    (["trainer.mtp.num_speculative_tokens=auto", "trainer.mtp.explore_budget=0.9"],
     "trainer.mtp.explore_budget=0.9 is invalid: must be a share of engine time in"),
    (["trainer.mtp.num_speculative_tokens=auto", "trainer.mtp.explore_budget=-0.01"],
     "trainer.mtp.explore_budget=-0.01 is invalid"),
    (["trainer.mtp.num_speculative_tokens=2", "trainer.mtp.explore_budget=0.01"],
     "trainer.mtp.explore_budget=0.01 is invalid: applies only with trainer.mtp.num_speculative_tokens=auto"),
    (["trainer.mtp.policy_trace_dir=/tmp/x"], "trainer.mtp.policy_trace_dir='/tmp/x' is invalid: applies only with"),
    (["trainer.mtp.num_speculative_tokens=auto", "trainer.mtp.policy_trace_dir=' '"],
     "trainer.mtp.policy_trace_dir=' ' is invalid: must be a directory path"),
])
def test_bad_speculation_keys_are_named(overrides, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(["recipe=tiny_dapo", *overrides])


def test_probabilistic_drafting_reaches_vllm_and_warns_about_the_coupling():
    cfg = load_config(["recipe=tiny_dapo", "trainer.mtp.draft_sample_method=probabilistic", "trainer.mtp.loss_type=tv"])
    with pytest.warns(UserWarning, match="draft-invariant coupling does not cover"):
        ec = engine_config(cfg, "/tmp/model")
    assert ec.speculative_config["draft_sample_method"] == "probabilistic"
    assert "draft_sample_method" not in engine_config(load_config(["recipe=tiny_dapo"]), "/tmp/model").speculative_config


def test_idle_head_budget_reaches_the_loop_only_when_the_depths_follow_the_engines():
    auto = loop_config(load_config(["recipe=tiny_dapo", "trainer.mtp.num_speculative_tokens=auto"]))
    assert auto.head_max_depths == 3 and auto.idle_head_train_budget == 0.01
    fixed_depths = loop_config(load_config(["recipe=tiny_dapo", "trainer.mtp.num_speculative_tokens=auto",
                                            "trainer.mtp.train_depths=2"]))
    assert fixed_depths.head_max_depths is None and fixed_depths.idle_head_train_budget == 1.0
    fixed_k = loop_config(load_config(["recipe=tiny_dapo", "trainer.mtp.num_speculative_tokens=2"]))
    assert fixed_k.head_max_depths is None and fixed_k.idle_head_train_budget == 1.0
    for bad in ("0", "1.5", "-0.01"):
        with pytest.raises(ConfigError, match=rf"trainer\.mtp\.idle_head_train_budget={bad}.*in \(0, 1\]"):
            load_config(["recipe=tiny_dapo", f"trainer.mtp.idle_head_train_budget={bad}"])
