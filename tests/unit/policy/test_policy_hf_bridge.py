"""HF <-> Megatron weight mapping: exact round trip (TP=1 and TP=2 shards) and strict key checks."""

import pytest
import torch
from mimo_fixture import mimo_config, random_mimo_weights

from skyrl_mtp.policy.megatron.hf_bridge import WeightMappingError, hf_to_megatron, megatron_to_hf, name_map
from skyrl_mtp.policy.megatron.model_builder import HFModelArgs, ModelBuildError, resolve_mtp_layers


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_identity(tie, tp):
    cfg = mimo_config(tie=tie)
    args = HFModelArgs.from_hf_config(cfg)
    hf = random_mimo_weights(cfg)
    shards = [hf_to_megatron(hf, args, 1, tp_rank=r, tp_size=tp) for r in range(tp)]
    back = megatron_to_hf(shards, args, 1)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_qkv_interleaving_and_eh_proj_swap():
    cfg = mimo_config()
    args = HFModelArgs.from_hf_config(cfg)
    hf = random_mimo_weights(cfg)
    mg = hf_to_megatron(hf, args, 1)
    d, per = args.head_dim, args.num_heads // args.num_kv_heads
    qkv = mg["decoder.layers.0.self_attention.linear_qkv.weight"]
    # group 0: its `per` q heads, then k head 0, then v head 0
    assert torch.equal(qkv[: per * d], hf["model.layers.0.self_attn.q_proj.weight"][: per * d])
    assert torch.equal(qkv[per * d:(per + 1) * d], hf["model.layers.0.self_attn.k_proj.weight"][:d])
    assert torch.equal(qkv[(per + 1) * d:(per + 2) * d], hf["model.layers.0.self_attn.v_proj.weight"][:d])
    h = args.hidden_size
    eh, ip = mg["mtp.layers.0.eh_proj.weight"], hf["model.mtp_layers.0.input_proj.weight"]
    assert torch.equal(eh[:, :h], ip[:, h:]) and torch.equal(eh[:, h:], ip[:, :h])
    # TP shard of fc1 is [gate_r; up_r]
    fc1 = hf_to_megatron(hf, args, 1, tp_rank=1, tp_size=2)["decoder.layers.0.mlp.linear_fc1.weight"]
    half = args.intermediate_size // 2
    assert torch.equal(fc1[:half], hf["model.layers.0.mlp.gate_proj.weight"][half:])
    assert torch.equal(fc1[half:], hf["model.layers.0.mlp.up_proj.weight"][half:])


def test_missing_and_extra_tensors_are_named():
    cfg = mimo_config()
    args = HFModelArgs.from_hf_config(cfg)
    hf = random_mimo_weights(cfg)
    bad = dict(hf)
    del bad["model.layers.1.mlp.up_proj.weight"]
    bad["model.layers.7.foo.weight"] = torch.zeros(1)
    with pytest.raises(WeightMappingError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\].*unexpected \['model.layers.7.foo.weight'\]"):
        hf_to_megatron(bad, args, 1)
    mg = hf_to_megatron(hf, args, 1)
    del mg["mtp.layers.0.eh_proj.weight"]
    with pytest.raises(WeightMappingError, match="mtp.layers.0.eh_proj.weight"):
        megatron_to_hf([mg], args, 1)


def test_mtp_layers_default_and_disable():
    cfg = mimo_config(mtp_layers=1)
    args = HFModelArgs.from_hf_config(cfg)
    assert resolve_mtp_layers(args, None) == 1
    assert resolve_mtp_layers(args, 0) == 0
    assert resolve_mtp_layers(args, None, mtp_enabled=False) == 0
    with pytest.raises(ModelBuildError, match="mtp_num_layers=2"):
        resolve_mtp_layers(args, 2)
    # a model without MTP layers ignores nothing: MTP tensors of unbuilt layers are skipped, the rest is strict
    hf = random_mimo_weights(cfg)
    mg = hf_to_megatron(hf, args, 0)
    assert not any(k.startswith("mtp.") for k in mg)
    assert set(name_map(args, 0)) == set(mg)
