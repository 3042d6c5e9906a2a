"""Model families: each knows its HF config -> Megatron model, its weight mapping and its MTP inputs.

``family_for_config`` picks the family of an HF config.json (by ``architectures``, else ``model_type``);
adding a family = one module here plus a line in ``FAMILIES`` (and a tiny checkpoint builder for tests).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from skyrl_mtp.models.families.base import (
    ModelBuildError,
    ModelFamily,
    ModelShape,
    MTPReplayInputs,
    WeightMappingError,
    WeightRule,
)
from skyrl_mtp.models.families.deepseek_v3 import DEEPSEEK_V3
from skyrl_mtp.models.families.glm4_moe import GLM4_MOE
from skyrl_mtp.models.families.llama import LLAMA
from skyrl_mtp.models.families.mimo import MIMO
from skyrl_mtp.models.families.qwen3 import QWEN3
from skyrl_mtp.models.families.qwen3_5 import QWEN3_5
from skyrl_mtp.models.families.qwen3_5_moe import QWEN3_5_MOE
from skyrl_mtp.models.families.qwen3_next import QWEN3_NEXT

FAMILIES: tuple[ModelFamily, ...] = (MIMO, QWEN3_5, DEEPSEEK_V3, GLM4_MOE, QWEN3_NEXT, QWEN3_5_MOE, LLAMA, QWEN3)


def family_for_config(hf_cfg: dict) -> ModelFamily:
    for fam in FAMILIES:
        if fam.matches(hf_cfg):
            return fam
    known = {f.name: list(f.architectures) for f in FAMILIES}
    raise ModelBuildError(
        f"no model family for architectures={hf_cfg.get('architectures')!r}, model_type="
        f"{hf_cfg.get('model_type')!r}; supported (family: architectures): {known}")


def serving_family(hf_dir: str | Path) -> ModelFamily | None:
    """The family of a checkpoint an engine serves, None for architectures no family knows (vLLM may still
    serve them; the trainer cannot train them)."""
    cfg = read_hf_config(hf_dir)
    return next((f for f in FAMILIES if f.matches(cfg)), None)


def mtp_hf_names(names) -> set[str]:
    """Those of a checkpoint's tensor names (all of them) that belong to an MTP head, in any supported
    family's layout (MiMo ``model.mtp_layers.*``, Qwen3.5 ``mtp.*``, DeepSeek-V3 ``model.layers.{N+j}.*``)."""
    names = list(names)
    return set().union(*(f.mtp_hf_names(names) for f in FAMILIES))


def unsynced_hf_names(names) -> set[str]:
    """Those of a checkpoint's tensor names a weight sync neither sends nor needs, in any family's layout."""
    names = list(names)
    return set().union(*(f.unsynced_hf_names(names) for f in FAMILIES))


def checkpoint_mtp_layers(hf_cfg: dict) -> tuple[str, int]:
    """(config key, MTP layers) an HF config declares, read the way its family names them (MiMo:
    num_nextn_predict_layers, Qwen3.5: mtp_num_hidden_layers); configs of no supported family are read
    with ``num_nextn_predict_layers`` (0 if absent)."""
    fam = next((f for f in FAMILIES if f.matches(hf_cfg)), ModelFamily())
    return fam.mtp_config_key, fam.declared_mtp_layers(hf_cfg)




def family_by_name(name: str) -> ModelFamily:
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise ModelBuildError(f"model family {name!r} is unknown; allowed: {[f.name for f in FAMILIES]}")


def engine_kwargs_for_family(family: ModelFamily, kwargs: dict, user_kwargs: dict, *, on_cpu: bool = False) -> dict:
    """``kwargs`` with the family's required vLLM engine settings applied (``cpu_engine_overrides`` and, into the
    speculative config, ``cpu_draft_overrides`` too when ``on_cpu``); a conflicting value the user set explicitly in ``user_kwargs`` is an error naming the key."""
    out = dict(kwargs)
    required = family.required_engine_kwargs(on_cpu)
    for key, value in required.items():
        if key in user_kwargs and user_kwargs[key] != value:
            raise ModelBuildError(f"engine_kwargs.{key}={user_kwargs[key]!r} cannot be used with a {family.name} "
                                  f"checkpoint; allowed: {value!r} (vLLM needs it for this model family)")
        out[key] = copy.deepcopy(value)  # vLLM may mutate a dict/list value (e.g. appends to custom_ops)
    if on_cpu and family.cpu_draft_overrides and isinstance(out.get("speculative_config"), dict):
        out["speculative_config"] = {**out["speculative_config"], **copy.deepcopy(family.cpu_draft_overrides)}
    return out


def prepare_vllm_worker(name: str | None) -> str | None:
    """In a vLLM worker: make the served family's model code importable (None: no family needs it)."""
    if name:
        family_by_name(name).prepare_vllm_import()
    return name


def read_hf_config(hf_dir: str | Path) -> dict:
    p = Path(hf_dir) / "config.json"
    if not p.is_file():
        raise ModelBuildError(f"no config.json in HF checkpoint directory {str(hf_dir)!r}")
    return json.loads(p.read_text())


def family_for_checkpoint(hf_dir: str | Path) -> ModelFamily:
    return family_for_config(read_hf_config(hf_dir))


__all__ = ["FAMILIES", "ModelBuildError", "ModelFamily", "ModelShape", "MTPReplayInputs", "WeightMappingError", "WeightRule",
           "checkpoint_mtp_layers", "engine_kwargs_for_family", "family_by_name", "family_for_checkpoint", "family_for_config",
           "mtp_hf_names", "prepare_vllm_worker", "read_hf_config", "unsynced_hf_names",
           "serving_family"]


# attribute set on every Megatron model built by policy.megatron.model_builder: the family whose replay inputs
# and weight rules it follows
FAMILY_ATTR = "skyrl_model_family"


def family_of_model(model) -> ModelFamily:
    """The family a model was built for (searching through wrappers that keep it as ``.module``)."""
    m = model
    while m is not None:
        fam = m.__dict__.get(FAMILY_ATTR) if hasattr(m, "__dict__") else None
        if fam is not None:
            return fam
        m = getattr(m, "module", None)
    raise ModelBuildError("model was not built by policy.megatron.model_builder.build_gpt_model (which tags it with FAMILY_ATTR): its model family "
                          "is unknown (pass the family's MTPReplayInputs explicitly)")
