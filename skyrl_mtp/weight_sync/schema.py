"""What a weight update must look like: the engine's weight schema and the checks run before anything moves.

A sync must never leave an engine half-updated, so every update (its names, shapes and dtypes, as
declared by the sender's `WeightSource.metadata()`) is checked against the engine's weight schema
(the tensors of the HF checkpoint it serves) before any tensor is sent or loaded. A sync has two
parts, pushed as two vLLM weight-update sessions: the main model, and the MTP drafter (which vLLM
reloads separately: `start_draft_weight_update`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from skyrl_mtp.models.families.packed_experts import PackedExperts

# safetensors dtype tags <-> torch dtypes (the ones a policy can export).
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_TORCH_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float64: "float64", torch.int64: "int64", torch.int32: "int32", torch.int8: "int8",
                torch.uint8: "uint8", torch.bool: "bool"}
_NAME_TO_TORCH = {v: k for k, v in _TORCH_NAMES.items()}

# Names the MTP drafter's load_weights keeps (vllm/model_executor/models/mimo_mtp.py filters the same way).


class WeightSyncError(ValueError):
    """A weight update that does not match the engine's weights; nothing was sent."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str   # torch dtype name, e.g. "float32"


WeightSchema = dict[str, TensorSpec]


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _TORCH_NAMES:
        raise WeightSyncError(f"unsupported tensor dtype {dtype}; supported: {sorted(_NAME_TO_TORCH)}")
    return _TORCH_NAMES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    if name not in _NAME_TO_TORCH:
        raise WeightSyncError(f"unknown dtype name {name!r}; known: {sorted(_NAME_TO_TORCH)}")
    return _NAME_TO_TORCH[name]


def _read_safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def read_weight_schema(model_path: str | Path) -> WeightSchema:
    """Names, shapes and dtypes of every tensor in the checkpoint's *.safetensors files (headers only); routed
    experts stored packed are listed one expert at a time (models/families/packed_experts.py)."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise WeightSyncError(f"no *.safetensors files in {str(model_path)!r}")
    schema: WeightSchema = {}
    for path in files:
        for name, info in _read_safetensors_header(path).items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _ST_DTYPES:
                raise WeightSyncError(f"{path.name}: tensor {name!r} has unsupported dtype {info['dtype']}")
            schema[name] = TensorSpec(tuple(int(s) for s in info["shape"]), dtype_name(_ST_DTYPES[info["dtype"]]))
    packed = PackedExperts({n: spec.shape for n, spec in schema.items()})
    if packed:   # a sync sends experts one by one (vLLM loads either layout): the schema names them so
        schema = {n: TensorSpec(shape, schema[packed.views[n].stored if n in packed.views else n].dtype)
                  for n, shape in packed.view_shapes({n: spec.shape for n, spec in schema.items()}).items()}
    return schema


def validate_update(shapes_dtypes: Mapping[str, tuple[tuple[int, ...], str]], schema: WeightSchema,
                    engine_dtype: str, optional: Collection[str] = ()) -> None:
    """Check a full weight update (name -> (shape, dtype name)) against the engine's schema.

    Every name of the schema must be present (a partial update would leave layers half-loaded)
    except those in `optional` (the MTP head's, when the engine serves no drafter), no other name
    may appear, shapes must match exactly and the dtype must be the checkpoint's or the engine's
    own dtype. Raises WeightSyncError listing what is wrong.
    """
    problems: list[str] = []
    unknown = sorted(set(shapes_dtypes) - set(schema))
    if unknown:
        problems.append(f"unknown weight names {unknown[:5]}{' ...' if len(unknown) > 5 else ''} "
                        f"(the engine's weights are HF names such as {sorted(schema)[:3]})")
    missing = sorted(set(schema) - set(shapes_dtypes) - set(optional))
    if missing:
        problems.append(f"missing weight names {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                        f"({len(missing)} of {len(schema)}; a sync must carry every weight, main model and MTP head)")
    for name in sorted(set(shapes_dtypes) & set(schema)):
        shape, dtype = shapes_dtypes[name]
        want = schema[name]
        if tuple(shape) != want.shape:
            problems.append(f"weight {name!r} has shape {tuple(shape)}; allowed: {want.shape}")
        allowed = sorted({want.dtype, engine_dtype})
        if dtype not in allowed:
            problems.append(f"weight {name!r} has dtype {dtype}; allowed: {allowed}")
    if problems:
        raise WeightSyncError("weight sync rejected, engines keep their current weights: " + "; ".join(problems))


def describe_tensors(named_tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    for name, t in named_tensors.items():
        if not isinstance(t, torch.Tensor):
            raise WeightSyncError(f"weight {name!r} is a {type(t).__name__}; allowed: a torch.Tensor")
        out[name] = (tuple(t.shape), dtype_name(t.dtype))
    return out


PARTS = ("main", "draft")


def part_names(names: Collection[str], part: str) -> list[str]:
    """The names one part of a sync carries (the policy's `iter_hf_weights(part)` streams): "main" =
    everything but the drafter; "draft" = the MTP layers (or an external drafter's tensors). vLLM's MTP drafter shares the target's
    embedding and lm_head modules (spec_decode/llm_base_proposer.py, pipeline size 1), so the main part
    refreshes those for it; the drafter's layerwise reload puts back what it was not sent. Tensors neither part
    carries (``unsynced_hf_names``: e.g. DeepSeek MTP layers' copies of the embedding and lm_head, which vLLM's
    drafter replaces by the target's) are left out of both."""
    from skyrl_mtp.drafters.kinds import is_external_drafter_tensor
    from skyrl_mtp.models.families import mtp_hf_names, unsynced_hf_names

    skip = unsynced_hf_names(names)
    names = [n for n in names if n not in skip]
    # the MTP layers, or an external drafter's tensors (never the target's embedding or lm_head, which that drafter
    # shares: the main part refreshes them)
    mtp = mtp_hf_names(names) | {n for n in names if is_external_drafter_tensor(n)}
    if part == "main":
        return [n for n in names if n not in mtp]
    if part == "draft":
        return [n for n in names if n in mtp]
    raise ValueError(f"weight-sync part {part!r} is invalid; allowed: {PARTS}")


def part_schema(schema: WeightSchema, part: str) -> WeightSchema:
    return {n: schema[n] for n in part_names(list(schema), part)}


def check_update_info(update_info: Mapping, schema: WeightSchema, part: str, engine_dtype: str) -> None:
    """Check one update chunk as vLLM's transports declare it (`names`, `dtype_names`, `shapes`) against one
    part of the engine's schema. A chunk may carry only some of the part's tensors (IPC packs several
    chunks per session), so completeness is the sender's check (`validate_update` on its metadata)."""
    try:
        names, dtypes, shapes = update_info["names"], update_info["dtype_names"], update_info["shapes"]
    except (KeyError, TypeError) as err:
        raise WeightSyncError(f"weight update info lacks names/dtype_names/shapes: {err!r}") from err
    declared = {n: (tuple(s), d) for n, d, s in zip(names, dtypes, shapes)}
    want = part_schema(schema, part)
    validate_update(declared, want, engine_dtype, optional=set(want) - set(declared))
