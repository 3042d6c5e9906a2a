"""An engine drafting with an exported external drafter (EAGLE-3, DFlash): its config, the checks before it starts,
and which tensors each part of a weight sync carries (pure logic: no engine)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from skyrl_mtp.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from skyrl_mtp.drafters.eagle3_export import check_eagle3_export, export_eagle3
from skyrl_mtp.rollout.config import EngineConfig
from skyrl_mtp.weight_sync.schema import part_names

TARGET = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 128, "max_position_embeddings": 256}


@pytest.fixture
def export(tmp_path):
    cfg = Eagle3Config.from_target(TARGET)
    return export_eagle3(Eagle3Drafter(cfg, torch.Generator().manual_seed(0)), cfg, tmp_path / "eagle3")


def test_the_engine_drafts_with_method_eagle3_from_the_export(export, tmp_path):
    cfg = EngineConfig(model_path=str(tmp_path), num_speculative_tokens=2, draft_model_path=export)
    assert cfg.speculative_config == {"method": "eagle3", "model": str(export), "num_speculative_tokens": 2}
    check_eagle3_export(export, TARGET)


@pytest.mark.parametrize("kw,words", [
    ({"num_speculative_tokens": 0}, "unless num_speculative_tokens >= 1"),
    ({"num_speculative_tokens": 2, "adaptive_speculation": True}, "without adaptive speculation"),
    ({"num_speculative_tokens": 2, "pipeline_parallel_size": 2}, "pipeline parallelism"),
])
def test_eagle3_combinations_not_built_are_refused_naming_the_field(export, tmp_path, kw, words):
    with pytest.raises(ValueError, match="EngineConfig.draft_model_path=") as info:
        EngineConfig(model_path=str(tmp_path), draft_model_path=export, **kw)
    assert words in str(info.value)
    with pytest.raises(ValueError, match="a directory holding an exported eagle3 drafter's config.json"):
        EngineConfig(model_path=str(tmp_path), num_speculative_tokens=2, draft_model_path=tmp_path / "none")


@pytest.mark.parametrize("target,words", [
    ({"architectures": ["MiMoForCausalLM"]}, "emit no EAGLE-3 hidden states"),
    ({"hidden_size": 64}, "hidden_size=32 differs from the target's 64"),
    ({"num_hidden_layers": 1}, "eagle_aux_hidden_state_layer_ids=[1, 2, 3]; allowed: three ids in 0..1"),
])
def test_an_export_that_does_not_fit_the_target_is_refused(export, target, words):
    with pytest.raises(ValueError, match="EngineConfig.draft_model_path=") as info:
        check_eagle3_export(export, {**TARGET, **target})
    assert words in str(info.value)


def test_the_draft_part_carries_the_drafters_tensors_never_the_shared_target_ones(export):
    drafter = set(load_file(str(export / "model.safetensors")))
    target = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight",
              "lm_head.weight"}
    names = sorted(drafter | target)
    assert set(part_names(names, "draft")) == drafter and "fc.weight" in drafter and "norm.weight" in drafter
    assert set(part_names(names, "main")) == target


@pytest.fixture
def dflash_export(tmp_path):
    from skyrl_mtp.drafters.dflash import DFlashConfig, DFlashDrafter
    from skyrl_mtp.drafters.dflash_export import export_dflash

    cfg = DFlashConfig.from_target(TARGET, num_layers=2, block_size=3)
    return export_dflash(DFlashDrafter(cfg, torch.Generator().manual_seed(0)), cfg, tmp_path / "dflash")


def test_the_engine_drafts_with_method_dflash_and_checks_the_export_against_the_target(dflash_export, tmp_path):
    from skyrl_mtp.rollout.config import check_checkpoint

    (tmp_path / "config.json").write_text(__import__("json").dumps(TARGET))
    (tmp_path / "model.safetensors").touch()
    cfg = EngineConfig(model_path=str(tmp_path), num_speculative_tokens=2, draft_model_path=dflash_export,
                       draft_method="dflash")
    assert cfg.speculative_config == {"method": "dflash", "model": str(dflash_export), "num_speculative_tokens": 2}
    assert check_checkpoint(cfg) == TARGET
    (tmp_path / "config.json").write_text(__import__("json").dumps({**TARGET, "vocab_size": 256}))
    with pytest.raises(ValueError, match=r"EngineConfig.draft_model_path=.* vocab_size=128 differs"):
        check_checkpoint(cfg)
    with pytest.raises(ValueError, match=r"EngineConfig.draft_method='medusa' is invalid: allowed: \['eagle3', 'dflash'\]"):
        EngineConfig(model_path=str(tmp_path), num_speculative_tokens=2, draft_model_path=dflash_export,
                     draft_method="medusa")


def test_a_dflash_draft_part_carries_its_layers_never_the_targets(dflash_export):
    drafter = set(load_file(str(dflash_export / "model.safetensors")))
    target = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight",
              "lm_head.weight"}
    names = sorted(drafter | target)
    assert set(part_names(names, "draft")) == drafter and {"fc.weight", "hidden_norm.weight"} <= drafter
    assert any(n.startswith("layers.1.") for n in drafter) and set(part_names(names, "main")) == target
