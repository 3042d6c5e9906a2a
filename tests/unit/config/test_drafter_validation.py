"""trainer.drafter.*: bad values, a kind on a model it cannot draft for, layer ids out of range, an export that does
not fit the target and the combinations an EAGLE-3 drafter is not tested with are refused before anything starts,
naming the key, the value and what is allowed; a valid EAGLE-3 config reaches the policy workers' config."""

from __future__ import annotations

import json

import pytest

from skyrl_mtp.config import ConfigError, load_config
from skyrl_mtp.trainer.run_plan import policy_worker_config

LLAMA = ["recipe=tiny_dapo", "model.tiny.family=llama", "trainer.drafter.kind=eagle3"]
DFLASH = ["recipe=tiny_dapo", "model.tiny.family=llama", "trainer.drafter.kind=dflash"]


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(list(overrides))
    return info.value.problems


@pytest.mark.parametrize("overrides,words", [
    (["recipe=tiny_dapo", "trainer.drafter.kind=medusa"],
     "trainer.drafter.kind='medusa' is invalid: must be one of ['mtp', 'eagle3', 'dflash']"),
    (["recipe=tiny_dapo", "trainer.drafter.kind=eagle3"],
     "trainer.drafter.kind='eagle3' is invalid: must be 'mtp' with the tiny mimo model (model.tiny): vLLM captures "
     "the hidden states eagle3 reads only of ['LlamaForCausalLM', 'Qwen3ForCausalLM']"),
    (["recipe=tiny_dapo", "trainer.drafter.layer_ids=[0,1,2]"],
     "trainer.drafter.layer_ids=[0, 1, 2] is invalid: applies only with trainer.drafter.kind=eagle3 or dflash"),
    ([*LLAMA, "trainer.drafter.layer_ids=[0,1,3]"],
     "trainer.drafter.layer_ids=[0, 1, 3] is invalid: must lie within 0..2 for the tiny llama model"),
    ([*LLAMA, "trainer.drafter.layer_ids=[2,1,0]"],
     "trainer.drafter.layer_ids=[2, 1, 0] is invalid: must be null (the kind's default for the target) or distinct"),
    ([*LLAMA, "trainer.drafter.init=/nonexistent"],
     "trainer.drafter.init='/nonexistent' is invalid: must be null or a directory with an exported eagle3 drafter"),
    ([*LLAMA, "trainer.mtp.enabled=false"], "trainer.mtp.enabled=False is invalid: must be true with "
                                            "trainer.drafter.kind=eagle3"),
    ([*LLAMA, "trainer.mtp.num_speculative_tokens=auto"],
     "trainer.mtp.num_speculative_tokens='auto' is invalid: must be a fixed k with trainer.drafter.kind=eagle3"),
    ([*LLAMA, "megatron.pp=2", "trainer.placement.policy_num_workers=2"],
     "megatron.pp=2 is invalid: must be 1 with trainer.drafter.kind=eagle3"),
    ([*LLAMA, "trainer.async_rl.mode=one_step_off"],
     "trainer.async_rl.mode='one_step_off' is invalid: must be 'sync' with trainer.drafter.kind=eagle3"),
    ([*LLAMA, "trainer.drafter.block_size=4"],
     "trainer.drafter.block_size=4 is invalid: applies only with trainer.drafter.kind=dflash"),
    ([*DFLASH, "trainer.drafter.block_size=2"],
     "trainer.drafter.block_size=2 is invalid: must be null (trainer.mtp.num_speculative_tokens + 1) or an int > "
     "trainer.mtp.num_speculative_tokens = 2"),
    ([*DFLASH, "trainer.drafter.layer_ids=[0]"],
     "trainer.drafter.layer_ids=[0] is invalid: must be null (the kind's default for the target) or distinct"),
    ([*DFLASH, "trainer.drafter.layer_ids=[1,3]"],
     "trainer.drafter.layer_ids=[1, 3] is invalid: must lie within 0..2 for the tiny llama model"),
    ([*DFLASH, "trainer.drafter.mask_token_id=512"],
     "trainer.drafter.mask_token_id=512 is invalid: must be a token id below the vocabulary size 512"),
    ([*DFLASH, "trainer.drafter.anchors=0"], "trainer.drafter.anchors=0 is invalid: must be >= 1"),
    ([*DFLASH, "trainer.mtp.train_depths=2"],
     "trainer.mtp.train_depths=2 is invalid: must be null with trainer.drafter.kind=dflash"),
    ([*DFLASH, "trainer.mtp.loss_position_fraction=0.5"],
     "trainer.mtp.loss_position_fraction=0.5 is invalid: must be 1.0 with trainer.drafter.kind=dflash"),
])
def test_bad_drafter_settings_are_refused_naming_the_key(overrides, words):
    problems = _problems(*overrides)
    assert any(p.startswith(words) for p in problems), problems


def test_an_export_for_another_target_is_refused(tmp_path):
    from skyrl_mtp.drafters.eagle3 import Eagle3Config
    from skyrl_mtp.drafters.eagle3_export import eagle3_hf_config
    from skyrl_mtp.models.tiny import TinyModelSpec, hf_config

    other = Eagle3Config.from_target(hf_config(TinyModelSpec(family="llama", hidden=256), None))
    (tmp_path / "config.json").write_text(json.dumps(eagle3_hf_config(other)))
    (tmp_path / "model.safetensors").touch()
    problems = _problems(*LLAMA, f"trainer.drafter.init={tmp_path}")
    assert problems == [f"trainer.drafter.init='{tmp_path}' is invalid: must be an eagle3 export for the tiny llama "
                        "model (model.tiny): its hidden_size=256 differs from the target's 128"], problems


def test_an_eagle3_run_reaches_the_policy_workers_as_a_drafter_without_mtp_layers():
    w = policy_worker_config(load_config([*LLAMA, "trainer.drafter.layer_ids=[0,1,2]", "trainer.mtp.train_depths=3"]))
    assert (w.drafter_kind, w.drafter_layer_ids, w.mtp_enabled, w.mtp_num_layers, w.mtp_num_depths) == \
        ("eagle3", (0, 1, 2), False, 0, 3)
    assert w.mtp_loss_weight == 1.0
    off = policy_worker_config(load_config(["recipe=tiny_dapo", "model.tiny.family=llama", "trainer.mtp.enabled=false"]))
    assert (off.drafter_kind, off.mtp_enabled, off.mtp_loss_weight) == ("mtp", False, 0.0)


def test_a_dflash_run_reaches_the_policy_workers_with_its_block_and_layers():
    w = policy_worker_config(load_config([*DFLASH, "trainer.drafter.num_layers=2", "trainer.drafter.anchors=16",
                                          "trainer.drafter.layer_ids=[1,2]"]))
    assert (w.drafter_kind, w.drafter_layer_ids, w.drafter_num_layers, w.drafter_block_size, w.drafter_anchors,
            w.drafter_mask_token_id, w.mtp_enabled) == ("dflash", (1, 2), 2, 3, 16, None, False)
    assert policy_worker_config(load_config([*DFLASH, "trainer.drafter.block_size=6"])).drafter_block_size == 6
