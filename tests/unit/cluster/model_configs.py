"""HF config.json contents of the headline recipes' models, for the memory plan (sizes only, no weights).

MiMo-7B (-RL): hidden 4096, 36 layers, 32 heads, 8 KV heads (head dim 128), SwiGLU 11008, vocabulary 151680, qkv
bias, untied LM head, one MTP layer (XiaomiMiMo's config.json; slime's scripts/models/mimo-7B-rl.sh agrees).
Qwen3.5-9B: hidden 4096, 32 layers (every 4th full attention, the rest Gated DeltaNet), 16 heads with an output
gate, 4 KV heads of dim 256, SwiGLU 12288, vocabulary 248320, DeltaNet 16 key / 32 value heads of dim 128, one MTP
layer, multimodal layout (text_config)."""

from __future__ import annotations

import json
from pathlib import Path

MIMO_7B = {
    "architectures": ["MiMoForCausalLM"], "model_type": "qwen2", "hidden_size": 4096, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 11008, "vocab_size": 151680,
    "max_position_embeddings": 32768, "rope_theta": 640000, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1, "hidden_act": "silu", "torch_dtype": "bfloat16",
}

QWEN3_5_9B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 4096, "num_hidden_layers": 32, "full_attention_interval": 4,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 12288,
        "vocab_size": 248320, "max_position_embeddings": 262144, "attn_output_gate": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "mtp_num_hidden_layers": 1, "torch_dtype": "bfloat16"},
}

QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
              "num_hidden_layers": 48, "num_nextn_predict_layers": 1}

FOR_RECIPE = {"mimo7b_dapo": MIMO_7B, "mimo7b_searchr1": MIMO_7B, "qwen3_5_9b_dapo": QWEN3_5_9B,
              "qwen3next_dapo": QWEN3_NEXT}


def write_config(directory: Path, cfg: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory
