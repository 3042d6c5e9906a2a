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
    ("trainer.async_rl.mode=fully", "trainer.async_rl.mode='fully' is invalid: must be one of "
                                    "['sync', 'one_step_off', 'fully_async']"),
    ("trainer.async_rl.max_staleness=-1", "trainer.async_rl.max_staleness=-1 is invalid: must be >= 0"),
    ("trainer.async_rl.max_staleness=2", "trainer.async_rl.max_staleness=2 is invalid: is read only with "
                                         "trainer.async_rl.mode=fully_async (mode='sync'); leave it at 1"),
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
])
@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_async_modes_refuse_what_they_cannot_do_or_have_not_been_tested_with(overrides, words, mode):
    assert words.replace("one_step_off", mode) in _problems(f"trainer.async_rl.mode={mode}", *overrides)
    load_config([*BASE, *overrides])   # each is fine in sync mode


def test_multi_turn_rollouts_run_fully_async_only():
    search = ["environment.name=search", "data.synthetic=search"]
    assert ("environment.name='search' is invalid: must be 'math' with trainer.async_rl.mode=one_step_off"
            in _problems("trainer.async_rl.mode=one_step_off", *search))
    load_config([*BASE, "trainer.async_rl.mode=fully_async", *search])


def test_the_settings_reach_the_loop_and_the_loss():
    loop = loop_config(load_config([*BASE, "trainer.async_rl.mode=one_step_off", "algorithm.off_policy.correction=tis",
                                    "algorithm.off_policy.tis_cap=3", "algorithm.off_policy.tis_level=sequence"]))
    kw = dict(loop.loss_kwargs)
    assert loop.async_mode == "one_step_off"
    assert (kw["off_policy_correction"], kw["tis_cap"], kw["tis_level"]) == ("tis", 3.0, "sequence")
    default = loop_config(load_config(BASE))
    assert default.async_mode == "sync" and "off_policy_correction" not in dict(default.loss_kwargs)
    fully = loop_config(load_config([*BASE, "trainer.async_rl.mode=fully_async", "trainer.async_rl.max_staleness=0"]))
    assert (fully.async_mode, fully.max_staleness, fully.num_speculative_tokens) == ("fully_async", 0, 2)
