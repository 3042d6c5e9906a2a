"""HF config.json contents of the headline recipes' models, for the memory plan (sizes only, no weights).

MiMo-7B (-RL): hidden 4096, 36 layers, 32 heads, 8 KV heads (head dim 128), SwiGLU 11008, vocabulary 151680, qkv
bias, untied LM head, one MTP layer (XiaomiMiMo's config.json; slime's scripts/models/mimo-7B-rl.sh agrees).
Qwen3.5-9B: hidden 4096, 32 layers (every 4th full attention, the rest Gated DeltaNet), 16 heads with an output
gate, 4 KV heads of dim 256, SwiGLU 12288, vocabulary 248320, DeltaNet 16 key / 32 value heads of dim 128, one MTP
layer, multimodal layout (text_config).
Qwen3-Next-80B-A3B: Qwen3.5's hybrid trunk at hidden 2048, 48 layers, 16 heads / 2 KV heads of dim 256, MoE in
every layer: 512 experts of width 512, top 10, one gated shared expert of width 512, vocabulary 151936.
Qwen3.5-35B-A3B: Qwen3.5's hybrid trunk at hidden 2048, 40 layers (every 4th full attention), 16 heads / 2 KV
heads of dim 256, MoE in every layer: 256 experts of width 512, top 8, one gated shared expert of width 512,
vocabulary 248320, one MTP layer, multimodal layout (text_config): the defaults of transformers'
Qwen3_5MoeTextConfig, which it documents as the Qwen3.5-35B-A3B configuration.
GLM-4.5-Air: hidden 4096, 46 layers (the first dense, SwiGLU 10944), 96 heads / 8 KV heads of dim 128 with qkv bias,
128 experts of width 1408, top 8, one shared expert, vocabulary 151552, one MTP layer."""

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

QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 48,
    "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "intermediate_size": 5120, "vocab_size": 151936, "max_position_embeddings": 262144, "rope_theta": 10000000,
    "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "rms_norm_eps": 1e-6,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
}

# a Qwen3.5-shaped config of about 27B parameters standing in for the 27B checkpoint's own config.json (which the
# memory plan reads at launch): hidden 5120, 64 layers (every 4th full attention), 24 heads / 4 KV heads of dim 256,
# SwiGLU 17408, DeltaNet 16 key / 48 value heads of dim 128, one MTP layer
QWEN3_5_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64, "full_attention_interval": 4,
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 17408,
        "vocab_size": 248320, "max_position_embeddings": 262144, "attn_output_gate": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "mtp_num_hidden_layers": 1, "torch_dtype": "bfloat16"},
}

QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40, "full_attention_interval": 4,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 248320,
        "max_position_embeddings": 262144, "attn_output_gate": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "mtp_num_hidden_layers": 1, "torch_dtype": "bfloat16"},
}

GLM_4_5_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 4096, "num_hidden_layers": 46,
    "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 10944,
    "vocab_size": 151552, "max_position_embeddings": 131072, "rope_theta": 1000000, "partial_rotary_factor": 0.5,
    "attention_bias": True, "use_qk_norm": False, "rms_norm_eps": 1e-5, "n_routed_experts": 128,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 1408, "first_k_dense_replace": 1,
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
}

FOR_RECIPE = {"mimo7b_dapo": MIMO_7B, "mimo7b_searchr1": MIMO_7B, "qwen3_5_9b_dapo": QWEN3_5_9B,
              "qwen3next_dapo": QWEN3_NEXT, "qwen3_5_35b_a3b_dapo": QWEN3_5_35B_A3B,
              "glm4_5_air_dapo": GLM_4_5_AIR, "qwen3_5_27b_dapo": QWEN3_5_27B}


def write_config(directory: Path, cfg: dict) -> Path:
    """A stand-in checkpoint: `cfg` as config.json, with the files validation looks for (tokenizer files with a
    chat template, a weights file) present but empty of content."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    (directory / "tokenizer.json").write_text("{}")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (directory / "model.safetensors").touch()
    return directory
