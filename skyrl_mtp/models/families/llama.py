"""Llama (``LlamaForCausalLM``: Llama 2 / 3 / 3.1 / 3.2): a dense decoder without MTP layers (dense_common.py).

What is Llama's own in config.json: Llama 3's RoPE scaling (``rope_scaling.rope_type: llama3``), which
megatron-core computes with fixed low/high frequency factors and original context (dense_common.LLAMA3_ROPE_FIXED),
the values every Llama 3.x release uses; ``attention_bias=true`` is refused (it gives o_proj a bias too, which
Megatron's attention does not have; no released Llama sets it). vLLM serves it with its own LlamaForCausalLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_mtp.models.families.dense_common import DenseArgs, DenseFamily, dense_fields, refuse, rope_settings


@dataclass(frozen=True)
class LlamaArgs(DenseArgs):
    @property
    def family(self) -> LlamaFamily:
        return LLAMA

    @classmethod
    def from_hf_config(cls, cfg: dict) -> LlamaArgs:
        if cfg.get("attention_bias", False):
            raise refuse("Llama", "attention_bias", True, "False (Megatron's attention has no o_proj bias)")
        theta, factor = rope_settings(cfg, "Llama", llama3_scaling=True)
        return cls(**dense_fields(cfg, "Llama"), rope_theta=theta, rope_scaling_factor=factor, qk_norm=False)


class LlamaFamily(DenseFamily):
    name = "llama"
    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)
    args_class = LlamaArgs


LLAMA = LlamaFamily()
