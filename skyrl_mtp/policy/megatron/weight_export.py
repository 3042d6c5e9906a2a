"""The policy's HF-named export, gathered over tensor- and expert-parallel ranks one tensor at a time.

Every rank holds the same Megatron names (under expert parallelism its experts are numbered locally from 0),
so the export walks rank 0's names: a non-expert tensor is gathered over the TP group (one rule), an expert
tensor over the EP group, each rank's copy being a different global expert (one rule per EP rank). The
walk is a collective: every rank of the TP and EP groups takes part, in the same order; every rank
receives the full tensors. Under pipeline parallelism (``StageBroadcast``) the names are the global ones; the
stage that owns a tensor (pipeline_stages.StageLayout.owner) gathers it within its stage and broadcasts it over
the pipeline group, so every stage walks the same stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from skyrl_mtp.models.families.base import WeightRule, rules_for_expert_rank


@dataclass(frozen=True)
class ExportItem:
    local_name: str                 # the Megatron tensor every rank holds under this name
    rules: tuple[WeightRule, ...]   # the global rule of that tensor on EP rank 0, 1, ... (one for non-experts)

    @property
    def is_expert(self) -> bool:
        return self.rules[0].expert is not None

    def hf_names(self) -> list[str]:
        return [n for r in self.rules for n in r.hf_names]


def export_plan(global_rules: dict[str, WeightRule], ep_size: int) -> list[ExportItem]:
    """The export, item by item, in the order of rank 0's rules."""
    per_rank = [rules_for_expert_rank(global_rules, e, ep_size) for e in range(ep_size)]
    out = []
    for name, rule in per_rank[0].items():
        out.append(ExportItem(name, tuple(r[name] for r in per_rank) if rule.expert is not None else (rule,)))
    return out


def _gather(t: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    if size == 1:
        return [t.to("cpu", copy=True)]   # a copy: the consumer must not alias a live parameter
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)   # on the rank's device
    return [p.cpu() for p in parts]


@dataclass(frozen=True)
class StageBroadcast:
    """What the export needs under pipeline parallelism: this rank's stage layout, the pipeline group (and its
    global ranks, by stage), the HF shapes and the dtype a stage receives a tensor it does not hold in."""

    layout: Any                      # pipeline_stages.StageLayout
    group: Any
    ranks: tuple[int, ...]
    hf_shapes: dict[str, tuple[int, ...]]
    dtype: torch.dtype
    device: torch.device

    def share(self, item: ExportItem, mine: list[tuple[str, torch.Tensor]] | None):
        owner = self.layout.owner(item.local_name)
        for i, name in enumerate(item.hf_names()):
            buf = mine[i][1].to(self.device) if mine is not None else torch.empty(
                self.hf_shapes[name], dtype=self.dtype, device=self.device)
            dist.broadcast(buf, src=self.ranks[owner], group=self.group)
            yield name, mine[i][1] if mine is not None else buf.cpu()


def _item_tensors(item: ExportItem, t: torch.Tensor, *, tp_size: int, tp_group, ep_size: int, ep_group):
    t = t.detach()
    if item.is_expert:   # experts are whole on the rank that holds them (expert tensor parallel size 1)
        pieces = [[p] for p in _gather(t, ep_size, ep_group)]
    else:
        pieces = [_gather(t, tp_size, tp_group)]
    for rule, parts in zip(item.rules, pieces):
        for name, full in zip(rule.hf_names, rule.to_hf(parts)):
            yield name, full.contiguous()


def iter_export(plan: list[ExportItem], tensors: dict[str, torch.Tensor], *, tp_size: int, tp_group,
                ep_size: int, ep_group, stages: StageBroadcast | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full CPU tensor) pairs of ``plan``; a collective over the TP and EP groups (and the pipeline
    group with ``stages``: ``tensors`` then holds this stage's own tensors, under their global names)."""
    groups = dict(tp_size=tp_size, tp_group=tp_group, ep_size=ep_size, ep_group=ep_group)
    for item in plan:
        if stages is None:
            yield from _item_tensors(item, tensors[item.local_name], **groups)
            continue
        t = tensors.get(item.local_name)
        mine = list(_item_tensors(item, t, **groups)) if t is not None else None
        yield from stages.share(item, mine)


def export_layout(plan: list[ExportItem], tensors: dict[str, torch.Tensor], hf_shapes: dict[str, tuple[int, ...]],
                  default_dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor ``iter_export`` yields, in its order (``default_dtype`` for tensors
    another pipeline stage holds)."""
    return [(n, hf_shapes[n], tensors[item.local_name].dtype if item.local_name in tensors else default_dtype)
            for item in plan for n in item.hf_names()]
