"""The weights a sync pushes, as vLLM `WeightSource`s: the policy's streamed export, or a dict in memory.

`PolicyWeightSource` streams one part ("main" or "draft") of the Megatron policy's HF-named export,
tensor by tensor in layer order (`MegatronPolicy.iter_hf_weights`, a collective over the policy's TP
ranks, so every rank iterates it in lockstep). Its metadata comes from one pass of that export, cached:
names, shapes and dtypes do not change between steps. `DictWeightSource` serves a dict of tensors (tests,
the driver-side push of a checkpoint) in vLLM's layerwise order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource, layerwise_groups

from skyrl_mtp.weight_sync.schema import WeightSyncError, part_names


def metadata_bytes(meta: list[ParamMeta]) -> int:
    return sum(torch.Size(m.shape).numel() * torch.empty((), dtype=m.dtype).element_size() for m in meta)


def describe_meta(meta: list[ParamMeta]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {m.name: (tuple(m.shape), str(m.dtype).removeprefix("torch.")) for m in meta}


class DictWeightSource(WeightSource):
    def __init__(self, named_tensors: Mapping[str, Any], part: str):
        names = part_names(list(named_tensors), part)
        for n in names:
            if not isinstance(named_tensors[n], torch.Tensor):
                raise WeightSyncError(f"weight {n!r} is a {type(named_tensors[n]).__name__}; allowed: a torch.Tensor")
        self._tensors = {n: named_tensors[n] for g in layerwise_groups(names) for n in g}

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self._tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._tensors.items())


class PolicyWeightSource(WeightSource):
    """`iter_part(part)` yields (hf_name, tensor) pairs, full tensors on the sending rank; `device`: where
    the transport needs them (None: as yielded)."""

    def __init__(self, iter_part: Callable[[str], Iterator[tuple[str, torch.Tensor]]], part: str,
                 device: torch.device | None = None):
        self._iter_part, self.part, self.device = iter_part, part, device
        self._meta: list[ParamMeta] | None = None

    def metadata(self) -> list[ParamMeta]:
        if self._meta is None:
            # a collective: every rank runs it; only the sender's (full) tensors describe the update
            self._meta = [ParamMeta(n, t.dtype, tuple(t.shape)) if t is not None else ParamMeta(n, torch.float32, ())
                          for n, t in self._iter_part(self.part)]
        return self._meta

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._iter_part(self.part):
            yield name, (t.to(self.device) if self.device is not None and t is not None else t)
