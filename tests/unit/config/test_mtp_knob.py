"""trainer.mtp is the one MTP knob: the engines' speculation and the head's training are built from it."""

import pytest

from skyrl_mtp.config import ConfigError, load_config
from skyrl_mtp.trainer.run_plan import engine_config, policy_worker_config

BASE = ["recipe=tiny_dapo"]


def _built(*overrides):
    cfg = load_config(BASE + list(overrides))
    return policy_worker_config(cfg), engine_config(cfg, "/model")


def test_enabled_builds_both_sides():
    pw, eng = _built("trainer.mtp.num_speculative_tokens=3", "trainer.mtp.loss_type=hard_ce",
                     "trainer.mtp.loss_weight=0.5")
    assert eng.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
    assert (pw.mtp_enabled, pw.mtp_loss_type, pw.mtp_loss_weight) == (True, "hard_ce", 0.5)
    assert pw.mtp_num_layers is None          # resolved from the checkpoint at model build
    assert pw.mtp_num_depths == 3             # train_depths=null: every depth it drafts


def test_train_depths_explicit_and_default():
    assert _built()[0].mtp_num_depths == 2                             # the recipe drafts k=2
    assert _built("trainer.mtp.train_depths=1")[0].mtp_num_depths == 1
    assert _built("trainer.mtp.num_speculative_tokens=1")[0].mtp_num_depths == 1


def test_disabled_turns_everything_off():
    pw, eng = _built("trainer.mtp.enabled=false")
    assert eng.speculative_config is None and eng.num_speculative_tokens == 0
    assert (pw.mtp_enabled, pw.mtp_num_layers, pw.mtp_loss_weight) == (False, 0, 0.0)


def test_draft_in_rollouts_false_trains_head_without_speculative_decoding():
    pw, eng = _built("trainer.mtp.draft_in_rollouts=false")
    assert eng.speculative_config is None
    assert pw.mtp_enabled and pw.mtp_loss_weight == 1.0


@pytest.mark.parametrize("override", ["generator.speculative_config={method:mtp}", "megatron.mtp_loss_type=tv",
                                      "megatron.mtp_loss_weight=2", "trainer.epochs=2",
                                      "megatron.mtp_detach_trunk=false"])
def test_removed_keys_are_unknown(override):
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(BASE + [override])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["megatron.mtp_num_layers=0"], "megatron.mtp_num_layers=0 is invalid: contradicts trainer.mtp.enabled=true"),
        (["trainer.mtp.enabled=false", "megatron.mtp_num_layers=1"],
         "megatron.mtp_num_layers=1 is invalid: contradicts trainer.mtp.enabled=false"),
        (["trainer.mtp.num_speculative_tokens=0"], "trainer.mtp.num_speculative_tokens=0 is invalid: must be >= 1"),
        (["trainer.mtp.train_depths=0"], "trainer.mtp.train_depths=0 is invalid: must be >= 1"),
    ],
)
def test_contradictions_are_one_error_each(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(BASE + overrides)
    assert expected in str(info.value)
    assert len(info.value.problems) == 1, info.value.problems
