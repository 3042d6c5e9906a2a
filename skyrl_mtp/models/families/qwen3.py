"""Qwen3 dense (``Qwen3ForCausalLM``): a dense decoder without MTP layers (dense_common.py) whose attention
normalises q and k per head (``self_attn.q_norm`` / ``k_norm``, RMSNorm over head_dim, before RoPE: Megatron's
``qk_layernorm``) and has no q/k/v bias. Sliding-window attention and RoPE scaling are refused by name (the
released Qwen3 dense checkpoints use neither). vLLM serves it with its own Qwen3ForCausalLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_mtp.models.families.dense_common import DenseArgs, DenseFamily, dense_fields, refuse, rope_settings


@dataclass(frozen=True)
class Qwen3Args(DenseArgs):
    @property
    def family(self) -> Qwen3Family:
        return QWEN3

    @classmethod
    def from_hf_config(cls, cfg: dict) -> Qwen3Args:
        if cfg.get("use_sliding_window", False):
            raise refuse("Qwen3", "use_sliding_window", True, "False")
        if cfg.get("attention_bias", False):
            raise refuse("Qwen3", "attention_bias", True, "False")
        theta, _ = rope_settings(cfg, "Qwen3", llama3_scaling=False)
        return cls(**dense_fields(cfg, "Qwen3"), rope_theta=theta, rope_scaling_factor=None, qk_norm=True)


class Qwen3Family(DenseFamily):
    name = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)
    args_class = Qwen3Args


QWEN3 = Qwen3Family()
