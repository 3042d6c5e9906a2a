"""`WeightSender`: the trainer side of a sync, in the process that holds the weights.

One sync = two vLLM weight-update sessions pushed through one trainer-side transfer engine: the main
model (`start_weight_update`) then the MTP drafter (`start_draft_weight_update`), each streamed from its
`WeightSource`. Every part is checked against the engines' weight schema (names, shapes, dtypes) before
anything is sent; a refused sync raises `WeightSyncError` naming the tensor and leaves the engines on
their previous weights. Returns per-part seconds and bytes.

On the `ipc` transport a failure after the engines' session started must not strand the other policy ranks:
vLLM's IPC trainer engine (distributed/weight_transfer/ipc_engine.py, `_send_packed`) runs, per chunk, an
all-gather of the handles over every policy rank, the sender's update call, then a barrier, so a sender whose
call raised would leave that loop alone and the others would wait in the collective until it timed out. There
the sender's client keeps the first failure and skips the rest of the session's calls (`FailuresAfterStart`),
the engines abort instead of finishing, and once every rank has left the loop they all raise it together.

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


class FailuresAfterStart:
    """A `VLLMWeightSyncClient` that never raises once a session started: it keeps the first failure, skips the
    remaining updates, and at finish asks the engines to abort (`abort_weight_update`) instead."""

    def __init__(self, client: Any):
        self.client = client
        self.failure: BaseException | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def _call(self, method: str, *args: Any) -> None:
        if self.failure is None:
            try:
                getattr(self.client, method)(*args)
            except Exception as err:   # noqa: BLE001 - kept, raised on every rank after the transfer loop
                self.failure = err

    def start_weight_update(self) -> None:
        self.failure = None
        self._call("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update")
        if self.failure is not None:
            try:
                self.client.abort_weight_update()
            except Exception as err:   # noqa: BLE001 - the first failure is the one to report
                self.failure.add_note(f"aborting the engines' sessions failed too: {type(err).__name__}: {err}")


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
        self.defers_failures = getattr(init_info, "backend", None) == "ipc"   # ranks agree after the transfer loop
        self.wire = FailuresAfterStart(client) if self.defers_failures else client
        self.engine = WeightTransferTrainerFactory.trainer_init(init_info, client=self.wire,
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
            self._raise_deferred(part)
            stats[f"sync/{part}_seconds"] = time.perf_counter() - t0
            stats[f"sync/{part}_bytes"] = float(metadata_bytes(source.metadata()))
        self.client.part = "main"
        return stats

    def _raise_deferred(self, part: str) -> None:
        """Every rank raises the sender's kept failure of this part's session (a collective on every rank)."""
        if not self.defers_failures:
            return
        failure = self.wire.failure if self.is_sender else None
        problem = self.agree(None if failure is None else f"{type(failure).__name__}: {failure}")
        if problem:
            raise WeightSyncError(f"weight sync of the {part} part failed after the engines' update session started; "
                                  f"the engines closed it (an engine whose model received part of the update "
                                  f"refuses to generate until a complete sync): {problem}")

    def shutdown(self) -> None:
        self.engine.shutdown()
