"""Moving the policy's weights (HF names) into running engines: checks, wire formats, NCCL sender.

A sync must never leave an engine half-updated, so every tensor is checked against the engine's
weight schema (the names, shapes and dtypes of the HF checkpoint it serves) before anything is
sent. Two transports share those checks:
- CPU: one safetensors blob (bytes survive vLLM's RPC, tensors do not), loaded by the worker extension.
- GPU: NCCL broadcast from the policy's rank 0 to every engine worker over a stateless group
  (rank 0 = sender, then each engine's TP workers in engine order); the receivers allocate from metadata.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

# safetensors dtype tags <-> torch dtypes (the ones a policy can export).
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_TORCH_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float64: "float64", torch.int64: "int64", torch.int32: "int32", torch.int8: "int8",
                torch.uint8: "uint8", torch.bool: "bool"}
_NAME_TO_TORCH = {v: k for k, v in _TORCH_NAMES.items()}

# Names the MTP drafter's load_weights keeps (vllm/model_executor/models/mimo_mtp.py filters the same way).
DRAFTER_NAME_MARKERS = ("mtp_layers", "embed_tokens", "lm_head")


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
    """Names, shapes and dtypes of every tensor in the checkpoint's *.safetensors files (headers only)."""
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


def serialize_weights(named_tensors: Mapping[str, torch.Tensor]) -> bytes:
    """One safetensors blob of CPU, contiguous, non-aliased copies (the CPU transport)."""
    from safetensors.torch import save

    return save({name: t.detach().to("cpu").contiguous().clone() for name, t in named_tensors.items()})


def deserialize_weights(blob: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(blob)


def drafter_subset(names: list[str]) -> list[str]:
    return [n for n in names if any(m in n for m in DRAFTER_NAME_MARKERS)]


# ---- NCCL transport (GPU) ------------------------------------------------------------------

@dataclass(frozen=True)
class NcclGroupLayout:
    """Rank 0 is the policy's sender; engine e's TP worker r is rank `engine_rank_offsets[e] + r`."""

    world_size: int
    engine_rank_offsets: tuple[int, ...]


def nccl_group_layout(engine_tp_sizes: list[int]) -> NcclGroupLayout:
    if not engine_tp_sizes or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in engine_tp_sizes):
        raise ValueError(f"engine_tp_sizes={engine_tp_sizes!r} is invalid: a non-empty list of ints >= 1")
    offsets, rank = [], 1
    for tp in engine_tp_sizes:
        offsets.append(rank)
        rank += tp
    return NcclGroupLayout(world_size=rank, engine_rank_offsets=tuple(offsets))


def broadcast_plan(named_tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, list[int], str]]:
    """The metadata receivers need, in the order the sender broadcasts: (name, shape, dtype name)."""
    return [(name, list(shape), dtype) for name, (shape, dtype) in describe_tensors(named_tensors).items()]


class NcclWeightSender:
    """Rank 0 of the weight-update group; lives in the policy's rank-0 process (one GPU).

    Construct it while the engines join (`EngineClient.begin_nccl_group`); it blocks until all ranks
    have joined. `send` broadcasts tensors in `broadcast_plan` order.
    """

    def __init__(self, master_addr: str, master_port: int, world_size: int, device: torch.device | int | str = 0):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        group = StatelessProcessGroup.create(host=master_addr, port=master_port, rank=0, world_size=world_size)
        self._comm = PyNcclCommunicator(group, device=self.device)

    def send(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        stream = torch.cuda.current_stream(self.device)
        for _name, t in named_tensors.items():
            self._comm.broadcast(t.detach().to(self.device).contiguous(), src=0, stream=stream)
        stream.synchronize()
