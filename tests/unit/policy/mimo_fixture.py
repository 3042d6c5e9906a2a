"""A random HF MiMo-layout state dict + config for policy tests (independent of models/tiny.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def mimo_config(*, hidden=64, layers=2, heads=4, kv_heads=2, inter=128, vocab=128, mtp_layers=1, tie=True) -> dict:
    return {
        "architectures": ["MiMoForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads, "intermediate_size": inter, "vocab_size": vocab,
        "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie, "num_nextn_predict_layers": mtp_layers, "hidden_act": "silu",
        "torch_dtype": "float32", "attention_dropout": 0.0, "use_sliding_window": False,
    }


def random_mimo_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i_, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def r(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    def norm():
        return 1.0 + r(h, scale=0.1)

    def block(p):
        return {p + "self_attn.q_proj.weight": r(q, h), p + "self_attn.q_proj.bias": r(q),
                p + "self_attn.k_proj.weight": r(kv, h), p + "self_attn.k_proj.bias": r(kv),
                p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.v_proj.bias": r(kv),
                p + "self_attn.o_proj.weight": r(h, q), p + "mlp.gate_proj.weight": r(i_, h),
                p + "mlp.up_proj.weight": r(i_, h), p + "mlp.down_proj.weight": r(h, i_),
                p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm()}

    sd = {"model.embed_tokens.weight": r(v, h, scale=0.5), "model.norm.weight": norm()}
    for i in range(cfg["num_hidden_layers"]):
        sd.update(block(f"model.layers.{i}."))
    for j in range(cfg["num_nextn_predict_layers"]):
        p = f"model.mtp_layers.{j}."
        sd.update(block(p))
        sd.update({p + "token_layernorm.weight": norm(), p + "hidden_layernorm.weight": norm(),
                   p + "final_layernorm.weight": norm(), p + "input_proj.weight": r(h, 2 * h)})
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = r(v, h, scale=0.5)
    return sd


def write_mimo_checkpoint(out: Path, cfg: dict, seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(random_mimo_weights(cfg, seed), str(out / "model.safetensors"))
    return out
