"""DAPO dynamic sampling: drop prompt groups whose rewards are all equal (zero advantage) and refill across rounds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GroupAccumulator:
    """Collects kept groups over generation rounds until `target_groups` are kept or `max_rounds` are used.

    `add_round(groups, rewards_per_group)` takes a list of opaque group payloads with their reward lists.
    With `keep_all=True` (dynamic sampling off) every group is kept: one round fills the batch.
    """

    target_groups: int
    max_rounds: int
    keep_all: bool = False
    kept: list[Any] = field(default_factory=list)
    rounds_used: int = 0
    groups_dropped: int = 0

    def __post_init__(self) -> None:
        if self.target_groups < 1:
            raise ValueError(f"target_groups={self.target_groups} must be >= 1")
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds={self.max_rounds} must be >= 1")

    def add_round(self, groups: list[Any], rewards_per_group: list[list[float]]) -> None:
        if len(groups) != len(rewards_per_group):
            raise ValueError(f"groups ({len(groups)}) and rewards_per_group ({len(rewards_per_group)}) differ")
        if self.done:
            raise RuntimeError("accumulator is done; call take() before adding rounds")
        self.rounds_used += 1
        for g, rs in zip(groups, rewards_per_group):
            if self.keep_all or (len(rs) > 0 and max(rs) > min(rs)):
                self.kept.append(g)
            else:
                self.groups_dropped += 1

    @property
    def done(self) -> bool:
        return len(self.kept) >= self.target_groups or self.rounds_used >= self.max_rounds

    def take(self) -> list[Any]:
        """Return at most target_groups kept groups (extras are discarded) and reset."""
        out = self.kept[: self.target_groups]
        self.kept, self.rounds_used, self.groups_dropped = [], 0, 0
        return out

    def stats(self) -> dict[str, float]:
        return {
            "dynamic_sampling/rounds": float(self.rounds_used),
            "dynamic_sampling/groups_dropped": float(self.groups_dropped),
            "dynamic_sampling/groups_kept": float(len(self.kept)),
        }
