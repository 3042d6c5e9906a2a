"""Build the megatron-core model of an HF checkpoint (trunk + optional MTP block) through its model family.

What the architecture is lives in ``skyrl_mtp.models.families`` (one module per family); this module only
reads the checkpoint's config, asks ``family_for_config`` for its family and tags the built model with it,
so the draft-loss replay and the weight bridge ask the same family.
"""

from __future__ import annotations

from pathlib import Path

from ...models.families import ModelBuildError, ModelFamily, family_for_config, read_hf_config
from ...models.families.mimo import HFModelArgs

__all__ = ["HFModelArgs", "ModelBuildError", "build_gpt_model", "family_of_model", "model_args_from_checkpoint",
           "model_args_from_config", "resolve_mtp_layers"]

# attribute set on every model built here: the family whose replay inputs / weight rules it follows
FAMILY_ATTR = "skyrl_model_family"


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


def build_gpt_model(args, *, mtp_num_layers: int, tp: int = 1, dtype: str = "float32", pp: int = 1, pp_rank: int = 0):
    """The family's GPTModel for ``args`` (pipeline stage ``pp_rank`` of ``pp``); model-parallel state must
    already be initialised."""
    family: ModelFamily = args.family
    model = family.build_model(args, mtp_num_layers=mtp_num_layers, tp=tp, dtype=dtype, pp=pp, pp_rank=pp_rank)
    object.__setattr__(model, FAMILY_ATTR, family)  # a plain attribute, not a submodule / parameter
    return model


def family_of_model(model) -> ModelFamily:
    """The family a model was built for (searching through wrappers that keep it as ``.module``)."""
    m = model
    while m is not None:
        fam = m.__dict__.get(FAMILY_ATTR) if hasattr(m, "__dict__") else None
        if fam is not None:
            return fam
        m = getattr(m, "module", None)
    raise ModelBuildError("model was not built by policy.megatron.model_builder.build_gpt_model: its model family "
                          "is unknown (pass the family's MTPReplayInputs explicitly)")
