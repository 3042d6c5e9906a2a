"""The policy's HF-named export, gathered over tensor- and expert-parallel ranks one tensor at a time.

Every rank holds the same Megatron names (under expert parallelism its experts are numbered locally from 0),
so the export walks rank 0's names: a non-expert tensor is gathered over the TP group (one rule), an expert
tensor over the EP group, each rank's copy being a different global expert (one rule per EP rank). The
walk is a collective: every rank of the TP and EP groups takes part, in the same order; every rank
receives the full tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

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


def iter_export(plan: list[ExportItem], tensors: dict[str, torch.Tensor], *, tp_size: int, tp_group,
                ep_size: int, ep_group) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full CPU tensor) pairs of ``plan``; a collective over the TP and EP groups."""
    for item in plan:
        t = tensors[item.local_name].detach()
        if item.is_expert:   # experts are whole on the rank that holds them (expert tensor parallel size 1)
            pieces = [[p] for p in _gather(t, ep_size, ep_group)]
        else:
            pieces = [_gather(t, tp_size, tp_group)]
        for rule, parts in zip(item.rules, pieces):
            for name, full in zip(rule.hf_names, rule.to_hf(parts)):
                yield name, full.contiguous()


def export_layout(plan: list[ExportItem], tensors: dict[str, torch.Tensor],
                  hf_shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor ``iter_export`` yields, in its order."""
    return [(n, hf_shapes[n], tensors[item.local_name].dtype) for item in plan for n in item.hf_names()]
