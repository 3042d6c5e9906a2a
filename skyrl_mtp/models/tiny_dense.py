"""The tiny checkpoints of the dense families without MTP layers, for tiny.py: "llama" (``LlamaForCausalLM``,
Llama 3 style: RoPE theta 500000 with Llama 3's RoPE scaling, so the scaled frequencies are exercised, and a context
of factor x 8192 positions) and "qwen3"
(``Qwen3ForCausalLM``: per-head q/k RMSNorm). Neither has q/k/v biases or MTP layers (``spec.mtp_layers`` is read
as 0 for them, see TinyModelSpec)."""

from __future__ import annotations

from dataclasses import asdict

import torch

from skyrl_mtp.models.tiny_qwen3_5 import token_ids

DENSE_FAMILIES = ("llama", "qwen3")
_ARCH = {"llama": ("LlamaForCausalLM", "llama"), "qwen3": ("Qwen3ForCausalLM", "qwen3")}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def build_dense_weights(spec) -> dict[str, torch.Tensor]:
    """HF-named weights of a tiny llama / qwen3 model (norm scales 1, like the other tiny families)."""
    g = torch.Generator().manual_seed(spec.seed)
    h, v, d, i_ = spec.hidden, spec.vocab, spec.head_dim, spec.intermediate
    q, kv = spec.heads * d, spec.kv_heads * d

    def init(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    sd = {"model.embed_tokens.weight": init(v, h), "model.norm.weight": torch.ones(h)}
    for layer in range(spec.layers):
        p = f"model.layers.{layer}."
        sd.update({p + "self_attn.q_proj.weight": init(q, h), p + "self_attn.k_proj.weight": init(kv, h),
                   p + "self_attn.v_proj.weight": init(kv, h), p + "self_attn.o_proj.weight": init(h, q),
                   p + "mlp.gate_proj.weight": init(i_, h), p + "mlp.up_proj.weight": init(i_, h),
                   p + "mlp.down_proj.weight": init(h, i_), p + "input_layernorm.weight": torch.ones(h),
                   p + "post_attention_layernorm.weight": torch.ones(h)})
        if spec.family == "qwen3":
            sd.update({p + "self_attn.q_norm.weight": torch.ones(d), p + "self_attn.k_norm.weight": torch.ones(d)})
    if not spec.tie_word_embeddings:
        sd["lm_head.weight"] = init(v, h)
    return {k: t.contiguous() for k, t in sd.items()}


def dense_hf_config(spec, tokenizer) -> dict:
    arch, model_type = _ARCH[spec.family]
    # Llama's context is the scaled one (transformers warns when it is below the original 8192 positions)
    own = ({"rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_ROPE), "rms_norm_eps": 1e-5, "mlp_bias": False,
            "max_position_embeddings": int(LLAMA3_ROPE["factor"] * LLAMA3_ROPE["original_max_position_embeddings"])}
           if spec.family == "llama" else
           {"rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": spec.layers})
    return {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": "float32",
        **own,
        **token_ids(tokenizer),
        "skyrl_mtp_tiny_spec": asdict(spec),
    }
