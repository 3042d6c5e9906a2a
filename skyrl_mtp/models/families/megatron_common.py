"""Megatron settings every family shares: CPU-safe (no fused kernels, no dropout), dtype and TP checks."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

import torch

from .base import ModelBuildError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# The attribute of a MultiTokenPredictionLayer holding its transformer layer, by megatron-core release;
# the MTP weight names (mtp.layers.N.<name>.*) follow it.
MTP_INNER_LAYER_NAMES = {"0.16": "transformer_layer", "0.19": "mtp_model_layer"}


def mtp_inner_layer_name_from_fields(fields: Iterable[str]) -> str:
    """The one known inner-layer name among ``MultiTokenPredictionLayerSubmodules``' fields; raises naming
    the fields when there is none (a megatron-core layout this module does not know)."""
    fields = set(fields)
    found = [n for n in MTP_INNER_LAYER_NAMES.values() if n in fields]
    if len(found) != 1:
        raise ModelBuildError(f"megatron-core's MultiTokenPredictionLayerSubmodules has fields {sorted(fields)}: "
                              f"expected exactly one of {MTP_INNER_LAYER_NAMES} (releases and names known); "
                              "update MTP_INNER_LAYER_NAMES in models/families/megatron_common.py")
    return found[0]


@functools.cache
def mtp_inner_layer_name() -> str:
    """'transformer_layer' on megatron-core 0.16.x, 'mtp_model_layer' on 0.19.x: read from the installed
    release, so the weight rules and the draft-head replay name the layer the model really has."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayerSubmodules

    return mtp_inner_layer_name_from_fields(f.name for f in dataclasses.fields(MultiTokenPredictionLayerSubmodules))


def check_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ModelBuildError(f"dtype={dtype!r} is invalid; allowed: {tuple(DTYPES)}")
    return DTYPES[dtype]


def check_divisible(tp: int, **sizes: int) -> None:
    for name, v in sizes.items():
        if v % tp:
            raise ModelBuildError(f"{name}={v} is not divisible by tensor parallel size tp={tp}")


def gated_rmsnorm_decoder_kwargs(args, *, qkv_bias: bool) -> dict:
    """TransformerConfig fields of a pre-norm decoder with RMSNorm and a SwiGLU MLP (Qwen2/MiMo and the
    Qwen3.5 family): sizes from the family's args (num_layers, hidden_size, num_heads, num_kv_heads,
    head_dim, intermediate_size, rms_norm_eps)."""
    import torch.nn.functional as F

    return dict(
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
        add_qkv_bias=qkv_bias,
    )


def common_config_kwargs(*, tp: int, dtype: str, mtp_num_layers: int, pp: int = 1) -> dict:
    """TransformerConfig fields that do not depend on the architecture (pp: pipeline stages; the activations
    they pass each other are in the parameters' dtype)."""
    pipeline = {"pipeline_model_parallel_size": pp, "pipeline_dtype": check_dtype(dtype)} if pp > 1 else {}
    return dict(
        **pipeline,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        params_dtype=check_dtype(dtype),
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        use_cpu_initialization=True,
        mtp_num_layers=mtp_num_layers if mtp_num_layers > 0 else None,
        mtp_loss_scaling_factor=0.0,
    )


def pipeline_stage_flags(args, *, pp: int, pp_rank: int) -> dict:
    """GPTModel's pre_process / post_process of stage ``pp_rank`` of ``pp``; refuses what PP does not cover."""
    if not 0 <= pp_rank < pp:
        raise ModelBuildError(f"pp_rank={pp_rank} is invalid for pp={pp}; allowed: 0..{pp - 1}")
    if pp > 1 and args.tie_word_embeddings:
        raise ModelBuildError("tie_word_embeddings=True with pipeline parallelism (pp > 1) is not supported: the "
                              "output layer on the last stage would have to follow the first stage's embedding")
    if args.num_layers % pp:
        raise ModelBuildError(f"num_hidden_layers={args.num_layers} is not divisible by pipeline parallel size "
                              f"pp={pp}; allowed: a pp that divides the layer count")
    return {"pre_process": pp_rank == 0, "post_process": pp_rank == pp - 1}


def rope_base(theta: float):
    return int(theta) if float(theta).is_integer() else theta
