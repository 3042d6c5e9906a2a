"""trainer.async_rl.mode and algorithm.off_policy.*: bad values and combinations that cannot work (or are not
tested yet) are refused before anything starts, naming the key, the value and what is allowed."""

from __future__ import annotations

import pytest

from skyrl_mtp.config import ConfigError, load_config
from skyrl_mtp.trainer.run_plan import loop_config

BASE = ["recipe=tiny_dapo"]


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config([*BASE, *overrides])
    return str(info.value)


@pytest.mark.parametrize("override,words", [
    ("trainer.async_rl.mode=fully_async", "trainer.async_rl.mode='fully_async' is invalid: must be one of "
                                          "['sync', 'one_step_off']"),
    ("algorithm.off_policy.correction=is", "algorithm.off_policy.correction='is' is invalid: must be one of "
                                           "['none', 'tis', 'decoupled']"),
    ("algorithm.off_policy.tis_cap=0.5", "algorithm.off_policy.tis_cap=0.5 is invalid: must be >= 1"),
    ("algorithm.off_policy.tis_level=step", "algorithm.off_policy.tis_level='step' is invalid: must be one of "
                                            "['token', 'sequence']"),
    ("algorithm.off_policy.decoupled_weight_cap=1.0", "algorithm.off_policy.decoupled_weight_cap=1.0 is invalid: "
                                                      "must be > 1"),
])
def test_bad_values_are_refused_naming_the_key(override, words):
    assert words in _problems(override)


@pytest.mark.parametrize("overrides,words", [
    (["trainer.placement.colocate=true"], "trainer.placement.colocate=True is invalid: must be false with "
                                          "trainer.async_rl.mode=one_step_off"),
    (["trainer.mtp.num_speculative_tokens=auto"], "trainer.mtp.num_speculative_tokens='auto' is invalid: must be a "
                                                  "fixed k with trainer.async_rl.mode=one_step_off"),
    (["generator.pipeline_parallel_size=2", "trainer.mtp.num_speculative_tokens=2"],
     "generator.pipeline_parallel_size=2 is invalid: must be 1 with trainer.async_rl.mode=one_step_off"),
    (["generator.model_runner=v2", "trainer.placement.gpus_per_engine=1",
      "trainer.placement.gpus_per_policy_worker=1"],
     "generator.model_runner='v2' is invalid: must be 'v1' with trainer.async_rl.mode=one_step_off"),
    (["environment.name=search", "data.synthetic=search"],
     "environment.name='search' is invalid: must be 'math' with trainer.async_rl.mode=one_step_off"),
])
def test_one_step_off_refuses_what_it_cannot_do_or_has_not_been_tested_with(overrides, words):
    assert words in _problems("trainer.async_rl.mode=one_step_off", *overrides)
    load_config([*BASE, *overrides])   # each is fine in sync mode


def test_the_settings_reach_the_loop_and_the_loss():
    loop = loop_config(load_config([*BASE, "trainer.async_rl.mode=one_step_off", "algorithm.off_policy.correction=tis",
                                    "algorithm.off_policy.tis_cap=3", "algorithm.off_policy.tis_level=sequence"]))
    kw = dict(loop.loss_kwargs)
    assert loop.async_mode == "one_step_off"
    assert (kw["off_policy_correction"], kw["tis_cap"], kw["tis_level"]) == ("tis", 3.0, "sequence")
    default = loop_config(load_config(BASE))
    assert default.async_mode == "sync" and "off_policy_correction" not in dict(default.loss_kwargs)
