"""Routed experts that a checkpoint stores packed, seen one expert at a time.

transformers 5 keeps a MoE layer's routed experts as two 3-D tensors, ``{p}experts.gate_up_proj`` [E, 2*I, H]
(expert e's gate rows, then its up rows) and ``{p}experts.down_proj`` [E, H, I], and checkpoints written that way
(Qwen3.5-MoE's trunk; Qwen3.6's MTP layer too) store them so. The weight rules, the weight sync and vLLM's
loader name experts one by one (``{p}experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``). ``PackedExperts``
maps between the two: each per-expert name of a packed tensor is a view (stored tensor, expert, row range) that
a reader slices lazily, and an export writes each per-expert tensor back at its byte offset in the packed one,
so a checkpoint is written in the layout it was read in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch

GATE_UP, DOWN = "experts.gate_up_proj", "experts.down_proj"


class PackedExpertsError(ValueError):
    """A packed expert tensor has a shape that cannot be split into experts."""


@dataclass(frozen=True)
class ExpertView:
    stored: str               # the checkpoint's packed tensor
    expert: int
    rows: tuple[int, int]     # the view's row range within the expert's [rows, cols] slab
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows[1] - self.rows[0], self.cols)

    def element_offset(self, packed_shape: tuple[int, ...]) -> int:
        """Offset of the view's first element in the packed tensor (row-major, experts outermost)."""
        _, rows, cols = packed_shape
        return (self.expert * rows + self.rows[0]) * cols


class PackedExperts:
    """The packed expert tensors among a checkpoint's ``shapes`` (name -> shape) and their per-expert views."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]):
        self.packed: dict[str, tuple[int, ...]] = {}
        self.views: dict[str, ExpertView] = {}
        for name, shape in shapes.items():
            kind = GATE_UP if name.endswith("." + GATE_UP) else DOWN if name.endswith("." + DOWN) else None
            if kind is None:
                continue
            if len(shape) != 3:
                raise PackedExpertsError(f"packed expert tensor {name!r} has shape {tuple(shape)}; allowed: 3-D "
                                         "[experts, rows, cols]")
            prefix = name[: -len(kind)]
            experts, rows, cols = (int(s) for s in shape)
            self.packed[name] = (experts, rows, cols)
            if kind == GATE_UP:
                if rows % 2:
                    raise PackedExpertsError(f"{name!r} has shape {tuple(shape)}: dim 1 (gate; up) must be even")
                half = rows // 2
                for e in range(experts):
                    self.views[f"{prefix}experts.{e}.gate_proj.weight"] = ExpertView(name, e, (0, half), cols)
                    self.views[f"{prefix}experts.{e}.up_proj.weight"] = ExpertView(name, e, (half, rows), cols)
            else:
                for e in range(experts):
                    self.views[f"{prefix}experts.{e}.down_proj.weight"] = ExpertView(name, e, (0, rows), cols)
        clash = sorted(set(self.views) & set(shapes))
        if clash:
            raise PackedExpertsError(f"the checkpoint stores experts both packed and one by one: {clash[:3]}")

    def __bool__(self) -> bool:
        return bool(self.packed)

    def view_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """``shapes`` with every packed tensor replaced by its per-expert views (in the packed tensor's place)."""
        out: dict[str, tuple[int, ...]] = {}
        by_stored: dict[str, list[str]] = {}
        for v, view in self.views.items():
            by_stored.setdefault(view.stored, []).append(v)
        for name, shape in shapes.items():
            if name in self.packed:
                out.update({v: self.views[v].shape for v in by_stored[name]})
            else:
                out[name] = tuple(shape)
        return out

    def read(self, view_name: str, get_slice) -> torch.Tensor:
        """One view, read through ``get_slice(stored name)`` (safetensors' lazy slice: only the view's bytes)."""
        v = self.views[view_name]
        return get_slice(v.stored)[v.expert, v.rows[0]:v.rows[1], :]

    def unpack(self, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A full state dict with its packed tensors split into per-expert ones (views of the packed ones)."""
        shapes = {k: tuple(t.shape) for k, t in sd.items()}
        out = {}
        for name in self.view_shapes(shapes):
            if name in self.views:
                out[name] = self.read(name, sd.__getitem__)
            else:
                out[name] = sd[name]
        return out

    def pack(self, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inverse of ``unpack``: per-expert tensors of ``sd`` put back into new packed tensors; every view of
        a packed tensor must be present."""
        packed = {n: None for n in self.packed}
        out = {}
        for name, t in sd.items():
            v = self.views.get(name)
            if v is None:
                out[name] = t
                continue
            if packed[v.stored] is None:
                packed[v.stored] = torch.empty(self.packed[v.stored], dtype=t.dtype)
                out[v.stored] = packed[v.stored]
            packed[v.stored][v.expert, v.rows[0]:v.rows[1]].copy_(t)
        missing = sorted(n for n, v in self.views.items() if packed[v.stored] is not None and n not in sd)
        if missing:
            raise PackedExpertsError(f"cannot pack experts: missing {missing[:5]}")
        return out

    def stored_layout(self, layout: list[tuple[str, tuple[int, ...], torch.dtype]]):
        """(stored layout, pieces) for writing a stream of per-expert tensors into packed ones: ``layout`` is the
        stream's (name, shape, dtype) in order; the stored layout lists the checkpoint's tensors (a packed one
        where its first view appears); ``pieces`` gives, per stream entry in order, (stored name, byte offset)."""
        stored: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        seen: dict[str, torch.dtype] = {}
        pieces: list[tuple[str, int]] = []
        for name, shape, dtype in layout:
            v = self.views.get(name)
            if v is None:
                stored.append((name, tuple(shape), dtype))
                pieces.append((name, 0))
                continue
            if tuple(shape) != v.shape:
                raise PackedExpertsError(f"{name}: shape {tuple(shape)} != its packed view {v.shape}")
            if v.stored not in seen:
                seen[v.stored] = dtype
                stored.append((v.stored, self.packed[v.stored], dtype))
            elif seen[v.stored] != dtype:
                raise PackedExpertsError(f"{name}: dtype {dtype} differs from the rest of {v.stored!r} ({seen[v.stored]})")
            itemsize = torch.empty((), dtype=dtype).element_size()
            pieces.append((v.stored, v.element_offset(self.packed[v.stored]) * itemsize))
        got = Counter(st for st, _ in pieces if st in self.packed)
        want = Counter(v.stored for v in self.views.values())
        for s, n in got.items():
            if n != want[s]:
                raise PackedExpertsError(f"the stream writes {n} of the {want[s]} views of {s!r}")
        return stored, pieces
