"""Propagation of trainer.mtp into the training and inference settings."""

import pytest
from omegaconf import OmegaConf

from skyrl_mtp.config import ConfigError, compose_config, propagate_mtp_knob
from skyrl_mtp.config.schema import SkyRLConfig


def _cfg(**dotlist):
    cfg = OmegaConf.structured(SkyRLConfig)
    for key, value in dotlist.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, force_add=True)
    return cfg


def test_enabled_derives_both_sides():
    cfg = propagate_mtp_knob(_cfg(trainer__mtp__num_speculative_tokens=3, trainer__mtp__loss_type="hard_ce",
                                  trainer__mtp__loss_weight=0.5))
    assert OmegaConf.to_container(cfg.generator.speculative_config) == {"method": "mtp", "num_speculative_tokens": 3}
    assert cfg.megatron.mtp_loss_type == "hard_ce"
    assert cfg.megatron.mtp_loss_weight == 0.5
    assert cfg.megatron.mtp_num_layers is None  # resolved from the checkpoint at model build


def test_disabled_turns_everything_off():
    cfg = propagate_mtp_knob(_cfg(trainer__mtp__enabled=False))
    assert cfg.generator.speculative_config is None
    assert cfg.megatron.mtp_num_layers == 0
    assert cfg.megatron.mtp_loss_weight == 0.0


def test_explicit_agreeing_values_are_kept():
    cfg = _cfg(trainer__mtp__num_speculative_tokens=2, megatron__mtp_loss_type="soft_ce")
    cfg.generator.speculative_config = {"method": "mtp", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}
    propagate_mtp_knob(cfg)
    assert cfg.generator.speculative_config.draft_tensor_parallel_size == 1
    assert cfg.generator.speculative_config.num_speculative_tokens == 2


@pytest.mark.parametrize(
    "settings, key",
    [
        ({"megatron__mtp_loss_type": "hard_ce"}, "megatron.mtp_loss_type='hard_ce'"),
        ({"megatron__mtp_loss_weight": 3.0}, "megatron.mtp_loss_weight=3.0"),
        ({"megatron__mtp_num_layers": 0}, "megatron.mtp_num_layers=0"),
    ],
)
def test_contradictions_with_enabled_knob_are_errors(settings, key):
    with pytest.raises(ConfigError) as info:
        propagate_mtp_knob(_cfg(**settings))
    assert key in str(info.value)
    assert "contradicts trainer.mtp" in str(info.value)


def test_speculative_k_mismatch_is_error():
    cfg = _cfg(trainer__mtp__num_speculative_tokens=2)
    cfg.generator.speculative_config = {"method": "mtp", "num_speculative_tokens": 3}
    with pytest.raises(ConfigError, match=r"generator.speculative_config=.*'num_speculative_tokens': 3.*expected"):
        propagate_mtp_knob(cfg)


def test_spec_decoding_with_mtp_off_is_error():
    cfg = _cfg(trainer__mtp__enabled=False)
    cfg.generator.speculative_config = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ConfigError, match="speculative decoding needs the MTP head"):
        propagate_mtp_knob(cfg)


def test_k_below_one_is_error():
    with pytest.raises(ConfigError, match=r"trainer.mtp.num_speculative_tokens=0 .*>= 1"):
        propagate_mtp_knob(_cfg(trainer__mtp__num_speculative_tokens=0))


def test_cli_override_reaches_derived_keys():
    cfg = compose_config(["recipe=tiny_dapo", "trainer.mtp.num_speculative_tokens=3", "trainer.mtp.loss_type=tv"])
    propagate_mtp_knob(cfg)
    assert cfg.generator.speculative_config.num_speculative_tokens == 3
    assert cfg.megatron.mtp_loss_type == "tv"


def test_draft_in_rollouts_false_trains_head_without_speculative_decoding():
    from skyrl_mtp.config import load_config

    cfg = load_config(["recipe=tiny_dapo", "trainer.mtp.draft_in_rollouts=false"])
    assert cfg.generator.speculative_config is None
    assert cfg.megatron.mtp_loss_type == cfg.trainer.mtp.loss_type
    assert cfg.megatron.mtp_loss_weight == 1.0


def test_draft_in_rollouts_false_contradicts_explicit_speculative_config():
    import pytest

    from skyrl_mtp.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="draft_in_rollouts=false"):
        load_config(["recipe=tiny_dapo", "trainer.mtp.draft_in_rollouts=false",
                     "+generator.speculative_config={method: mtp, num_speculative_tokens: 2}"])
