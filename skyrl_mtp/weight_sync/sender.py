"""`WeightSender`: the trainer side of a sync, in the process that holds the weights.

One sync = two vLLM weight-update sessions pushed through one trainer-side transfer engine: the main
model (`start_weight_update`) then the MTP drafter (`start_draft_weight_update`), each streamed from its
`WeightSource`. Every part is checked against the engines' weight schema (names, shapes, dtypes) before
anything is sent; a refused sync raises `WeightSyncError` naming the tensor and leaves the engines on
their previous weights. Returns per-part seconds and bytes.

A push may carry only some of the parts (`parts=["main"]`): the engines keep the others as they are, e.g.
the drafter on a step where the head did not train (vLLM's drafter shares the target's embedding and
lm_head modules, so the main part still refreshes those for it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from vllm.distributed.weight_transfer.base import WeightSource

from skyrl_mtp.weight_sync.engine_actors_client import EngineActorsClient
from skyrl_mtp.weight_sync.registration import register_cpu_transport
from skyrl_mtp.weight_sync.schema import WeightSchema, WeightSyncError, part_schema, validate_update
from skyrl_mtp.weight_sync.sources import describe_meta, metadata_bytes


def _agree_alone(problem: str | None) -> str | None:
    return problem


class WeightSender:
    """`agree(problem_or_None) -> problem_or_None` makes every trainer rank reach the sender's verdict
    (ranks iterate sources in lockstep: a sender that stops alone would leave the others in a collective)."""

    def __init__(self, init_info: Any, client: EngineActorsClient, sources: Mapping[str, WeightSource],
                 parts: list[str], schema: WeightSchema, engine_dtype: str,
                 agree: Callable[[str | None], str | None] = _agree_alone):
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        register_cpu_transport()
        self.client, self.parts, self.schema, self.engine_dtype, self.agree = client, list(parts), schema, engine_dtype, agree
        self.sources = dict(sources)
        self.is_sender = init_info.is_sender
        self.engine = WeightTransferTrainerFactory.trainer_init(init_info, client=client,
                                                                source=self.sources[self.parts[0]])

    def _parts(self, parts: list[str] | None) -> list[str]:
        if parts is None:
            return self.parts
        unknown = [p for p in parts if p not in self.parts]
        if unknown or not parts:
            raise ValueError(f"weight-sync parts={parts!r} are invalid; allowed: a non-empty subset of {self.parts}")
        return [p for p in self.parts if p in parts]   # the engines' order: main before the drafter

    def _check(self, parts: list[str]) -> None:
        problem = None
        metas = {part: self.sources[part].metadata() for part in parts}   # a collective on every rank
        if self.is_sender:
            try:
                for part in parts:
                    validate_update(describe_meta(metas[part]), part_schema(self.schema, part), self.engine_dtype)
            except WeightSyncError as err:
                problem = str(err)
        problem = self.agree(problem)
        if problem:
            raise WeightSyncError(problem)

    def push(self, sources: Mapping[str, WeightSource] | None = None,
             parts: list[str] | None = None) -> dict[str, float]:
        """Push `parts` (default: all of them, main first); a part left out reports `sync/{part}_skipped` 1."""
        todo = self._parts(parts)
        if sources is not None:
            self.sources = dict(sources)
        self._check(todo)
        stats: dict[str, float] = {}
        for part in self.parts:
            stats[f"sync/{part}_skipped"] = float(part not in todo)
            stats[f"sync/{part}_seconds"] = stats[f"sync/{part}_bytes"] = 0.0
        for part in todo:
            source = self.sources[part]
            self.engine.source = source
            self.client.part = part
            t0 = time.perf_counter()
            self.engine.send_weights()
            stats[f"sync/{part}_seconds"] = time.perf_counter() - t0
            stats[f"sync/{part}_bytes"] = float(metadata_bytes(source.metadata()))
        self.client.part = "main"
        return stats

    def shutdown(self) -> None:
        self.engine.shutdown()
