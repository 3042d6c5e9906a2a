"""HF config.json contents of the EAGLE-3 and DFlash recipes' target models, for the memory plan (sizes only, no
weights).

Llama-3.1-8B(-Instruct): hidden 4096, 32 layers, 32 heads, 8 KV heads (head dim 128), SwiGLU 14336, vocabulary
128256, untied LM head, Llama 3 RoPE scaling (factor 8), no MTP layers (meta-llama's config.json).
Qwen3-8B: hidden 4096, 36 layers, 32 heads, 8 KV heads of dim 128 with per-head q/k RMSNorm, SwiGLU 12288,
vocabulary 151936, untied LM head, no MTP layers (Qwen's config.json).
"""

from __future__ import annotations

LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rms_norm_eps": 1e-05, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000, "rope_scaling": None,
    "rms_norm_eps": 1e-06, "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}

FOR_EAGLE3_RECIPE = {"llama3_1_8b_eagle3_dapo": LLAMA_3_1_8B, "qwen3_8b_eagle3_dapo": QWEN3_8B}
FOR_DFLASH_RECIPE = {"qwen3_8b_dflash_dapo": QWEN3_8B}
