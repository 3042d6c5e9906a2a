"""Megatron settings every family shares: CPU-safe (no fused kernels, no dropout), dtype and TP checks, activation
recompute, and the one choice of layer implementation (``megatron.layer_impl``, checked on the node by
``check_layer_impl``): megatron-core's local spec (the CPU path), the local spec with torch's SDPA as its core
attention (sdpa_attention.py), or Transformer Engine's. The local spec's attention materialises the [B, heads, S, S]
scores (about 13 GB per layer at micro-batch 2, 16 heads per rank, S=10240); SDPA's flash / memory-efficient kernels
on GPUs and Transformer Engine's never do."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

import torch

from skyrl_mtp.models.families.base import ModelBuildError

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


def transformer_engine_available() -> bool:
    """Transformer Engine imports, megatron-core's TE extension with it, and a GPU is present."""
    if not torch.cuda.is_available():
        return False
    try:
        from megatron.core.models.gpt import gpt_layer_specs
    except ImportError:   # pragma: no cover - megatron-core is a dependency
        return False
    return bool(getattr(gpt_layer_specs, "HAVE_TE", False))


def use_transformer_engine(requested: bool | None = None) -> bool:
    """The layer-spec choice every family makes through here: `requested` None = Transformer Engine when it is
    available; True = required (fails loudly where it is not); False = the local spec."""
    available = transformer_engine_available()
    if requested is None:
        return available
    if requested and not available:
        raise ModelBuildError("transformer_engine=True is invalid here: Transformer Engine (with megatron-core's TE "
                              "extension) does not import in this process, or it has no GPU; allowed: install "
                              "transformer_engine on the GPU nodes (the memory plan counted its fused attention), or "
                              "run where it imports")
    return bool(requested)


def check_layer_impl(layer_impl: str, device: torch.device | str = "cpu") -> None:
    """On the policy's node, before its model is built: the layer implementation ``megatron.layer_impl`` names is
    usable here (Transformer Engine imports with megatron-core's TE extension and a GPU; torch's SDPA runs as the
    core attention calls it). Raises naming the key, the value and what is allowed."""
    from skyrl_mtp.allowed import LAYER_IMPLS

    if layer_impl not in LAYER_IMPLS:
        raise ModelBuildError(f"megatron.layer_impl={layer_impl!r} is invalid; allowed: {LAYER_IMPLS}")
    if layer_impl == "transformer_engine" and not transformer_engine_available():
        raise ModelBuildError("megatron.layer_impl='transformer_engine' is invalid on this node: Transformer Engine "
                              "(with megatron-core's TE extension) does not import here, or there is no GPU; "
                              "allowed: sdpa or local, or install transformer_engine on the policy nodes")
    if layer_impl == "sdpa":
        from skyrl_mtp.models.families.sdpa_attention import check_sdpa_usable

        check_sdpa_usable(device)


def set_core_attention(layer_specs, transformer_engine: bool, local=None, sdpa: bool = False) -> None:
    """Every layer spec's core attention: Transformer Engine's fused / flash one (no parameters: the weight names
    stay the local spec's); with ``sdpa`` torch's scaled_dot_product_attention in the local module's place
    (sdpa_attention.py; ``local``, or megatron-core's DotProductAttention, is its base); else ``local`` (None: keep
    the spec's own)."""
    if transformer_engine and sdpa:
        raise ModelBuildError("transformer_engine=True and sdpa=True: one core attention per model "
                              "(megatron.layer_impl picks one)")
    if transformer_engine:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        local = TEDotProductAttention
    elif sdpa:
        from skyrl_mtp.models.families.sdpa_attention import sdpa_core_attention

        local = sdpa_core_attention(local)
    if local is None:
        return
    for spec in layer_specs:   # (specs may be shared objects: setting twice is harmless)
        spec.submodules.self_attention.submodules.core_attention = local


@functools.cache
def te_fused_norm_names() -> dict[str, str]:
    """Where a layer's norms live under Transformer Engine's spec, from megatron-core itself: the local spec's
    ``sharded_state_dict_keys_map`` (gpt_layer_specs.py) maps ``input_layernorm.`` to the fused
    ``self_attention.linear_qkv.layer_norm_`` and ``pre_mlp_layernorm.`` to ``mlp.linear_fc1.layer_norm_``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    mapping = dict(get_gpt_layer_local_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map)
    if set(mapping) != {"input_layernorm.", "pre_mlp_layernorm."}:
        raise ModelBuildError(f"megatron-core's local layer spec maps {mapping} for Transformer Engine checkpoints; "
                              "expected input_layernorm. and pre_mlp_layernorm. (update te_fused_norm_names)")
    return mapping


def rename_for_transformer_engine(rules: dict) -> dict:
    """Weight rules keyed by the local spec's parameter names -> the same rules under TE's fused-norm names."""
    mapping = te_fused_norm_names()
    out = {}
    for name, rule in rules.items():
        for local, fused in mapping.items():
            name = name.replace("." + local, "." + fused)
        out[name] = rule
    return out


def recompute_kwargs(recompute: bool) -> dict:
    """TransformerConfig fields of Megatron's full activation recompute, one layer per checkpoint (the layers'
    inputs are kept, each layer is re-run in backward): the one setting megatron.recompute_activations chooses."""
    if not recompute:
        return {}
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


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


def common_config_kwargs(*, tp: int, dtype: str, mtp_num_layers: int, recompute: bool = False, pp: int = 1) -> dict:
    """TransformerConfig fields that do not depend on the architecture (pp: pipeline stages; the activations
    they pass each other are in the parameters' dtype)."""
    pipeline = {"pipeline_model_parallel_size": pp, "pipeline_dtype": check_dtype(dtype)} if pp > 1 else {}
    return dict(
        **pipeline,
        **recompute_kwargs(recompute),
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
