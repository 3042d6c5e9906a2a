"""The dense families without MTP layers (llama, qwen3) through the family seam: picked and parsed from config.json
(unsupported settings refused by name), the exact HF <-> Megatron round trip at TP 1 / 2, the memory shape against
the tiny checkpoint's tensors, Megatron's logits equal to transformers' on each tiny checkpoint, and
trainer.mtp.enabled=true refused at validation for them."""

from __future__ import annotations

import json

import pytest
import torch

from skyrl_mtp.models.families import (
    ModelBuildError,
    checkpoint_mtp_layers,
    family_by_name,
    family_for_config,
    mtp_hf_names,
)
from skyrl_mtp.models.families.llama import LLAMA, LlamaArgs
from skyrl_mtp.models.families.qwen3 import QWEN3, Qwen3Args
from skyrl_mtp.models.tiny import TinyModelSpec, build_spec_weights, build_tiny_checkpoint, hf_config
from skyrl_mtp.policy.megatron.hf_bridge import hf_to_megatron, megatron_to_hf

DENSE = ("llama", "qwen3")


class _Tok:
    eos_token_id, pad_token_id = 2, 0

    def convert_tokens_to_ids(self, _):
        return 0


def cfg_of(family: str, **kw) -> dict:
    return hf_config(TinyModelSpec(family=family, **kw), _Tok())


def varied(family: str, seed: int = 1, **kw) -> dict[str, torch.Tensor]:
    """Factory weights with every norm redrawn (a mapping that swaps or drops one shows) and lm_head x8 (a peaked
    next-token distribution, so that a logits comparison can fail)."""
    g = torch.Generator().manual_seed(seed)
    sd = build_spec_weights(TinyModelSpec(family=family, **kw))
    sd = {k: (t + torch.randn(t.shape, generator=g) * 0.2 if "norm" in k else t) for k, t in sd.items()}
    if "lm_head.weight" in sd:
        sd["lm_head.weight"] = sd["lm_head.weight"] * 8.0
    else:
        sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"] * 8.0
    return sd


def test_dense_families_are_picked_and_have_no_mtp_layers():
    llama, qwen3 = cfg_of("llama"), cfg_of("qwen3")
    assert family_for_config(llama) is LLAMA and family_for_config(qwen3) is QWEN3
    assert family_for_config({"model_type": "llama"}) is LLAMA and family_for_config({"model_type": "qwen3"}) is QWEN3
    assert family_by_name("llama") is LLAMA and family_by_name("qwen3") is QWEN3
    a, b = LlamaArgs.from_hf_config(llama), Qwen3Args.from_hf_config(qwen3)
    assert (a.rope_theta, a.rope_scaling_factor, a.qk_norm, a.max_position) == (500000.0, 8.0, False, 65536)
    assert (b.rope_theta, b.rope_scaling_factor, b.qk_norm, b.head_dim) == (1000000.0, None, True, 32)
    assert a.family is LLAMA and b.family is QWEN3
    for cfg, fam, args in ((llama, LLAMA, a), (qwen3, QWEN3, b)):
        assert args.num_nextn_predict_layers == 0 and checkpoint_mtp_layers(cfg)[1] == 0
        assert not fam.has_mtp_layers and fam.memory_shape(args, 0).mtp_layers == 0
        assert mtp_hf_names(build_spec_weights(TinyModelSpec(family=fam.name))) == set()
        with pytest.raises(ModelBuildError, match=f"a {fam.name} model has no MTP layers"):
            fam.mtp_replay_inputs  # noqa: B018 - the property raises
        with pytest.raises(ModelBuildError, match=r"mtp_layers=1: .* has no MTP layers; allowed: 0"):
            fam.weight_rules(args, 1)
    # transformers 5's layout of the same RoPE settings reads the same
    new = {k: v for k, v in llama.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {**llama["rope_scaling"], "rope_theta": 500000.0}
    assert LlamaArgs.from_hf_config(new) == a


@pytest.mark.parametrize("family, change, match", [
    ("llama", {"attention_bias": True}, r"Llama config.json attention_bias=True is not supported; allowed: False"),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"rope_scaling.rope_type='yarn' is not supported; allowed: 'default' or 'llama3'"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}},
     r"rope_scaling.low_freq_factor=2.0 is not supported; allowed: 1.0"),
    ("llama", {"mlp_bias": True}, r"mlp_bias=True is not supported; allowed: False"),
    ("llama", {"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported; allowed: 'silu'"),
    ("qwen3", {"use_sliding_window": True}, r"Qwen3 config.json use_sliding_window=True is not supported"),
    ("qwen3", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     r"rope_scaling.rope_type='llama3' is not supported; allowed: 'default'"),
    ("qwen3", {"num_hidden_layers": None}, r"Qwen3 HF config is missing required fields \['num_hidden_layers'\]"),
])
def test_unsupported_dense_configs_are_refused_by_name(family, change, match):
    cfg = {**cfg_of(family), **change}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ModelBuildError, match=match):
        family_for_config(cfg).args_from_config(cfg)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", DENSE)
def test_round_trip_is_identity(family, tp, tie):
    cfg = cfg_of(family, tie_word_embeddings=tie)
    args = family_for_config(cfg).args_from_config(cfg)
    hf = varied(family, tie_word_embeddings=tie)
    shards = [hf_to_megatron(hf, args, 0, tp_rank=r, tp_size=tp) for r in range(tp)]
    assert ("decoder.layers.1.self_attention.q_layernorm.weight" in shards[0]) == (family == "qwen3")
    assert shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0] == (4 + 2 + 2) * 32 // tp
    back = megatron_to_hf(shards, args, 0)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


@pytest.mark.parametrize("family", DENSE)
def test_memory_shape_counts_the_tiny_checkpoint_tensor_by_tensor(family):
    cfg, weights = cfg_of(family), build_spec_weights(TinyModelSpec(family=family))
    shape = family_for_config(cfg).memory_shape(family_for_config(cfg).args_from_config(cfg), 0)
    assert shape.params == sum(t.numel() for t in weights.values())
    norms = sum(t.numel() for k, t in weights.items() if "norm" in k)
    assert shape.params_replicated == norms and shape.mtp_params_sharded == shape.mtp_params_replicated == 0


def test_tiny_factory_builds_dense_checkpoints_without_mtp_layers(tmp_path):
    from skyrl_mtp.models.tiny import main

    assert TinyModelSpec(family="llama", mtp_layers=1) == TinyModelSpec(family="llama", mtp_layers=0)
    assert main(["--family", "qwen3", "--out", str(tmp_path / "a")]) == 0
    build_tiny_checkpoint(tmp_path / "b", TinyModelSpec(family="qwen3"))
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["skyrl_mtp_tiny_spec"]["mtp_layers"] == 0


# ------------------------------------------------------------------------------------------ against transformers

@pytest.fixture(scope="module")
def megatron_rank():
    """A one-rank gloo group with Megatron's model-parallel state (kept when the session already has one)."""
    import torch.distributed as dist

    from skyrl_mtp.net import free_port
    from skyrl_mtp.policy.megatron.parallel_state import destroy_distributed, init_distributed

    ours = not dist.is_initialized()
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), tp=1, seed=0)
    yield
    if ours:
        destroy_distributed()


@pytest.mark.parametrize("family, tie", [("llama", False), ("llama", True), ("qwen3", False)])
def test_megatron_logits_equal_transformers(megatron_rank, family, tie):
    from transformers import AutoConfig, AutoModelForCausalLM

    from skyrl_mtp.policy.megatron.hf_bridge import load_into_model
    from skyrl_mtp.policy.megatron.model_builder import build_gpt_model

    cfg = cfg_of(family, tie_word_embeddings=tie)
    args = family_for_config(cfg).args_from_config(cfg)
    hf = varied(family, tie_word_embeddings=tie)
    model = build_gpt_model(args, mtp_num_layers=0).eval()
    load_into_model(model, hf_to_megatron(hf, args, 0))
    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).eval()
    missing, unexpected = ref.load_state_dict(hf, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tie else set()), (missing, unexpected)
    assert type(ref).__name__ == cfg["architectures"][0]
    # the same RoPE frequencies (Llama 3's scaled ones included: they change only the slowest, invisible in logits)
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq, ref.model.rotary_emb.inv_freq, atol=0, rtol=1e-6)
    ids = torch.randint(0, cfg["vocab_size"], (3, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        mine = torch.log_softmax(model(ids, torch.arange(40).expand(3, 40), None).float(), -1)
        want = torch.log_softmax(ref(input_ids=ids).logits.float(), -1)
    assert float(want.std(-1).mean()) > 0.1  # not a flat distribution: the comparison can fail
    torch.testing.assert_close(mine, want, atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ validation

@pytest.mark.parametrize("family", DENSE)
def test_mtp_drafting_is_refused_for_a_tiny_model_without_mtp_layers(family):
    from skyrl_mtp.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(["recipe=tiny_dapo", f"model.tiny.family={family}"])
    assert info.value.problems == [
        f"trainer.drafter.kind='mtp' is invalid: cannot draft with the tiny {family} model (model.tiny): it has no MTP "
        "layers (num_nextn_predict_layers=0); allowed: 'eagle3' or 'dflash' (targets ['LlamaForCausalLM', "
        "'Qwen3ForCausalLM']), "
        "or trainer.mtp.enabled=false (no speculation)"]
    for ok in ("trainer.mtp.enabled=false", "trainer.drafter.kind=eagle3", "trainer.drafter.kind=dflash"):
        cfg = load_config(["recipe=tiny_dapo", f"model.tiny.family={family}", ok])
        assert cfg.model.tiny.family == family


def test_mtp_drafting_is_refused_for_a_dense_checkpoint(tmp_path):
    from skyrl_mtp.config import ConfigError, load_config

    ckpt = build_tiny_checkpoint(tmp_path / "llama", TinyModelSpec(family="llama"))
    with pytest.raises(ConfigError) as info:
        load_config(["recipe=tiny_dapo", f"model.path={ckpt}", "trainer.warm_start.enabled=false"])
    assert info.value.problems == [
        "trainer.drafter.kind='mtp' is invalid: cannot draft with the llama model at model.path: it has no MTP layers "
        "(num_nextn_predict_layers=0); allowed: 'eagle3' or 'dflash' (targets ['LlamaForCausalLM', "
        "'Qwen3ForCausalLM']), or "
        "trainer.mtp.enabled=false (no speculation)"]
    for ok in ("trainer.mtp.enabled=false", "trainer.drafter.kind=eagle3", "trainer.drafter.kind=dflash"):
        load_config(["recipe=tiny_dapo", f"model.path={ckpt}", "trainer.warm_start.enabled=false", ok])
