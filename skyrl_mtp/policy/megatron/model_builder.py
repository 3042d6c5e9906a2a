"""Build the megatron-core model of an HF checkpoint (trunk + optional MTP block) through its model family.

What the architecture is lives in ``skyrl_mtp.models.families`` (one module per family); this module only
reads the checkpoint's config, asks ``family_for_config`` for its family and tags the built model with it,
so the draft-loss replay and the weight bridge ask the same family.
"""

from __future__ import annotations

from pathlib import Path

from skyrl_mtp.models.families import (
    FAMILY_ATTR,
    ModelBuildError,
    ModelFamily,
    family_for_config,
    family_of_model,
    read_hf_config,
)
from skyrl_mtp.models.families.mimo import HFModelArgs

__all__ = ["HFModelArgs", "ModelBuildError", "build_gpt_model", "family_of_model", "model_args_from_checkpoint",
           "model_args_from_config", "resolve_mtp_layers"]



def model_args_from_config(cfg: dict):
    """The family-specific model arguments of an HF config.json (each carries ``.family``)."""
    return family_for_config(cfg).args_from_config(cfg)


def model_args_from_checkpoint(path: str | Path):
    return model_args_from_config(read_hf_config(path))


def resolve_mtp_layers(args, requested: int | None, mtp_enabled: bool = True) -> int:
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


def build_gpt_model(args, *, mtp_num_layers: int, tp: int = 1, ep: int = 1, dtype: str = "float32",
                    moe_dispatcher: str = "allgather", moe_aux_loss_coeff: float = 0.0, recompute: bool = False,
                    transformer_engine: bool | None = None, pp: int = 1, pp_rank: int = 0, sdpa: bool = False,
                    fused_swiglu: bool = False):
    """The family's GPTModel for ``args`` (pipeline stage ``pp_rank`` of ``pp``); model-parallel state must
    already be initialised. The built TransformerConfig is checked for the recompute asked (a family that dropped
    it would fail here, not by OOM)."""
    family: ModelFamily = args.family
    model = family.build_model(args, mtp_num_layers=mtp_num_layers, tp=tp, ep=ep, dtype=dtype,
                               moe_dispatcher=moe_dispatcher, moe_aux_loss_coeff=moe_aux_loss_coeff,
                               recompute=recompute, transformer_engine=transformer_engine, pp=pp, pp_rank=pp_rank,
                               sdpa=sdpa)
    built = (getattr(model.config, "recompute_granularity", None), getattr(model.config, "recompute_method", None),
             getattr(model.config, "recompute_num_layers", None))
    want = ("full", "uniform", 1) if recompute else (None, None, None)
    if built != want:
        raise ModelBuildError(f"the {family.name} model was built with recompute (granularity, method, layers) = "
                              f"{built}, expected {want} for recompute={recompute}")
    keep_router_state_fp32(model)
    if fused_swiglu:
        enable_fused_swiglu(model)
    if mtp_num_layers or getattr(model.config, "num_moe_experts", None):
        reset_aux_loss_tracker()
    object.__setattr__(model, FAMILY_ATTR, family)  # a plain attribute, not a submodule / parameter
    return model


def enable_fused_swiglu(model) -> int:
    """megatron-core's fused SwiGLU in every MLP of ``model`` (its ``bias_activation_fusion``, which the families build
    off, the CPU-safe choice): MLP.forward then runs ``bias_swiglu_impl`` (fusions/fused_bias_swiglu.py, a compiled
    kernel that saves only the MLP's input) instead of silu(gate) * up (which also keeps silu(gate)). The flag is read
    at each forward, on each MLP's config; every one must be a SwiGLU. Returns how many MLPs were switched."""
    import inspect

    import torch.nn.functional as F
    from megatron.core.transformer.mlp import MLP

    if "bias_swiglu_impl" not in inspect.getsource(MLP.forward):
        raise ModelBuildError("megatron-core's MLP.forward no longer calls bias_swiglu_impl under "
                              "bias_activation_fusion: policy/megatron/model_builder.py enable_fused_swiglu must be "
                              "updated")
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    for m in mlps:
        if m.config.activation_func is not F.silu or not m.config.gated_linear_unit:
            raise ModelBuildError(f"fused_swiglu=True is invalid for this model: an MLP has activation "
                                  f"{m.config.activation_func} (gated: {m.config.gated_linear_unit}); allowed: SwiGLU")
    for m in mlps:
        m.config.bias_activation_fusion = True
    return len(mlps)


def reset_aux_loss_tracker() -> None:
    """Empty megatron-core's process-wide tracker of MoE / MTP auxiliary losses: it sizes each loss's per-layer
    values by the first model that logs it, so a later model of the process with more layers would index past it."""
    from megatron.core.transformer.moe import moe_utils

    get = getattr(moe_utils, "get_moe_layer_wise_logging_tracker", None)
    if get is None:
        raise ModelBuildError("megatron.core.transformer.moe.moe_utils.get_moe_layer_wise_logging_tracker is gone: "
                              "this megatron-core moved its auxiliary-loss tracker; pin megatron-core 0.16-0.19")
    get().clear()


def keep_router_state_fp32(model) -> None:
    """Routers' expert bias and token counts back to float32 after a cast of the model to bf16/fp16 (megatron-core
    keeps them in float32: routing on a rounded bias picks other experts)."""
    import torch

    for name, buf in model.named_buffers():
        if name.endswith(("router.expert_bias", "router.local_tokens_per_expert")) and buf.dtype != torch.float32:
            buf.data = buf.data.float()
