"""Build a megatron-core GPTModel (Qwen2/MiMo trunk + optional MTP block) from an HF config.json.

Only the local (non Transformer-Engine) layer spec is used so the same model builds on CPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


class ModelBuildError(ValueError):
    """The HF config cannot be turned into the requested Megatron model."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class HFModelArgs:
    """The fields of an HF Qwen2/MiMo config.json that the Megatron model needs."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    num_nextn_predict_layers: int

    @classmethod
    def from_hf_config(cls, cfg: dict) -> HFModelArgs:
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ModelBuildError(f"HF config is missing required fields {missing}")
        heads = int(cfg["num_attention_heads"])
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", True)),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> HFModelArgs:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ModelBuildError(f"no config.json in HF checkpoint directory {str(path)!r}")
        return cls.from_hf_config(json.loads(p.read_text()))


def resolve_mtp_layers(args: HFModelArgs, requested: int | None, mtp_enabled: bool = True) -> int:
    """Number of MTP layers to build: the checkpoint's by default, 0 disables."""
    if not mtp_enabled:
        return 0
    if requested is None:
        return args.num_nextn_predict_layers
    if requested > args.num_nextn_predict_layers:
        raise ModelBuildError(
            f"mtp_num_layers={requested} but the checkpoint has num_nextn_predict_layers="
            f"{args.num_nextn_predict_layers}; allowed: 0..{args.num_nextn_predict_layers} (or None)"
        )
    return requested


def transformer_config(args: HFModelArgs, *, mtp_num_layers: int, tp: int = 1, dtype: str = "float32"):
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dtype not in _DTYPES:
        raise ModelBuildError(f"dtype={dtype!r} is invalid; allowed: {tuple(_DTYPES)}")
    for name, v in (("num_attention_heads", args.num_heads), ("num_key_value_heads", args.num_kv_heads),
                    ("intermediate_size", args.intermediate_size), ("vocab_size", args.vocab_size)):
        if v % tp:
            raise ModelBuildError(f"{name}={v} is not divisible by tensor parallel size tp={tp}")
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_heads,
        num_query_groups=args.num_kv_heads,
        kv_channels=args.head_dim,
        ffn_hidden_size=args.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=args.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=args.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        params_dtype=_DTYPES[dtype],
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        use_cpu_initialization=True,
        mtp_num_layers=mtp_num_layers if mtp_num_layers > 0 else None,
        mtp_loss_scaling_factor=0.0,
    )


def build_gpt_model(args: HFModelArgs, *, mtp_num_layers: int, tp: int = 1, dtype: str = "float32"):
    """A GPTModel matching ``args``; model-parallel state must already be initialised."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    config = transformer_config(args, mtp_num_layers=mtp_num_layers, tp=tp, dtype=dtype)
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    mtp_spec = None
    if mtp_num_layers > 0:
        mtp_spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=args.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(args.rope_theta) if float(args.rope_theta).is_integer() else args.rope_theta,
        mtp_block_spec=mtp_spec,
    )
    return model.to(_DTYPES[dtype])
