"""What every pipeline stage must agree on after a speculative-decoding step, as plain data.

Under pipeline parallelism only the last stage samples, verifies drafts and proposes new ones; the other
stages run their layers on the tokens the scheduler sends them. The invariant that keeps the stages on one
token sequence (vLLM PR #44698, open upstream): the last stage broadcasts, per request of a step, the tokens
it kept (accepted drafts plus the bonus / recovered token) and the drafts it proposed; every stage applies
them to its own input tokens, `num_computed_tokens` and `num_accepted_tokens` (the accepted count a hybrid
model's Gated DeltaNet / mamba layers pick their state by).

This module is that payload and the rules derived from it: the step's layout (one row per scheduled request,
in the scheduler output's order, which every stage receives identically), the tensor the last stage
broadcasts, and `StepRecord`, which says where a request's kept tokens go and what the scheduler must report
as its `num_computed_tokens` at its next step; then how a stage applies the records to its runner's state. No
vLLM import: the patch (pipeline_parallel.py) feeds it vLLM's objects, the unit tests plain values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

UNKNOWN = -1   # a row the last stage had no sampler output for (payload column 0), and the token padding


@dataclass(frozen=True)
class ScheduledRequest:
    """One request of a step, as the scheduler output describes it to every stage."""
    req_id: str
    num_computed: int     # num_computed_tokens the step starts from
    num_scheduled: int    # tokens of the step (1 + drafts for a decode step)
    num_drafts: int       # drafts among them (verified this step)

    @property
    def first_sample_position(self) -> int:
        """Position of the step's first sampled token: right after its non-draft input tokens."""
        return self.num_computed + self.num_scheduled - self.num_drafts


def step_layout(scheduler_output: Any) -> list[ScheduledRequest]:
    """The requests of a vLLM SchedulerOutput in `num_scheduled_tokens` order (the order of the payload rows)."""
    computed = {r.req_id: int(r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, (int(n) for n in cached.num_computed_tokens)))
    spec = scheduler_output.scheduled_spec_decode_tokens
    out = []
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        if req_id not in computed:
            raise PipelineAccountingError(f"request {req_id!r} is scheduled but neither new nor cached in the "
                                          "scheduler output")
        out.append(ScheduledRequest(req_id, computed[req_id], int(n), len(spec.get(req_id, ()))))
    return out


class PipelineAccountingError(RuntimeError):
    """The stages (or the scheduler) disagree on a request's tokens or counts: outputs would silently diverge."""


def payload_width(k: int) -> int:
    """Columns per request: kept-token count, up to k + 1 kept tokens, up to k drafts."""
    return 1 + (k + 1) + k


def encode(layout: Sequence[ScheduledRequest], kept: Mapping[str, Sequence[int]],
           drafts: Mapping[str, Sequence[int]], k: int) -> torch.Tensor:
    """The last stage's payload [len(layout), payload_width(k)] int64; a request missing from `kept` gets
    count UNKNOWN."""
    out = torch.full((len(layout), payload_width(k)), UNKNOWN, dtype=torch.int64)
    for row, req in enumerate(layout):
        toks = kept.get(req.req_id)
        if toks is None:
            continue
        d = list(drafts.get(req.req_id, ()))
        if len(toks) > k + 1 or len(d) > k:
            raise PipelineAccountingError(f"request {req.req_id!r}: {len(toks)} kept tokens and {len(d)} drafts "
                                          f"exceed k={k} (at most k + 1 and k)")
        out[row, 0] = len(toks)
        out[row, 1:1 + len(toks)] = torch.tensor(list(toks), dtype=torch.int64)
        out[row, k + 2:k + 2 + len(d)] = torch.tensor(d, dtype=torch.int64)
    return out


@dataclass(frozen=True)
class StepRecord:
    """What a request's step left, as every stage must see it."""
    request: ScheduledRequest
    kept: tuple[int, ...]     # accepted drafts + bonus / recovered token; () when the step sampled nothing kept
    drafts: tuple[int, ...]   # proposed for the next step

    @property
    def next_num_computed(self) -> int:
        """num_computed_tokens the scheduler must send at the request's next step (the last kept token is that
        step's first input)."""
        return self.request.first_sample_position + max(len(self.kept), 1) - 1

    @property
    def num_accepted_tokens(self) -> int:
        """vLLM's `num_accepted_tokens` for the next step: tokens kept (1 when nothing was verified)."""
        return max(len(self.kept), 1)


def decode(payload: torch.Tensor, layout: Sequence[ScheduledRequest], k: int) -> dict[str, StepRecord]:
    """Records of the requests the payload knows (rows with count UNKNOWN are left out)."""
    if tuple(payload.shape) != (len(layout), payload_width(k)):
        raise PipelineAccountingError(f"payload shape {tuple(payload.shape)} != {(len(layout), payload_width(k))}")
    rows = payload.cpu().tolist()
    out = {}
    for req, row in zip(layout, rows):
        n = row[0]
        if n == UNKNOWN:
            continue
        if not 0 <= n <= k + 1:
            raise PipelineAccountingError(f"request {req.req_id!r}: payload says {n} kept tokens (k={k})")
        drafts = tuple(t for t in row[k + 2:] if t != UNKNOWN)
        out[req.req_id] = StepRecord(req, tuple(row[1:1 + n]), drafts)
    return out


def check_next_step(record: StepRecord, num_computed: int, new_token_ids: Sequence[int] | None,
                    scheduled_drafts: Sequence[int]) -> None:
    """What the scheduler sends for the request's next step must follow from the record (else raise)."""
    rid = record.request.req_id
    if num_computed != record.next_num_computed:
        raise PipelineAccountingError(
            f"request {rid!r}: the scheduler sends num_computed_tokens={num_computed}, the last pipeline stage's "
            f"step implies {record.next_num_computed} (started at {record.request.num_computed}, "
            f"{record.request.num_drafts} drafts, {len(record.kept)} tokens kept)")
    if new_token_ids and record.kept and int(new_token_ids[-1]) != record.kept[-1]:
        raise PipelineAccountingError(f"request {rid!r}: the scheduler's next input token {new_token_ids[-1]} is "
                                      f"not the last stage's last kept token {record.kept[-1]}")
    mismatch = [i for i, (s, d) in enumerate(zip(scheduled_drafts, record.drafts)) if s != UNKNOWN and s != d]
    if mismatch or len(scheduled_drafts) > len(record.drafts):
        raise PipelineAccountingError(f"request {rid!r}: scheduled drafts {list(scheduled_drafts)} are not the "
                                      f"last stage's proposal {list(record.drafts)}")


class StepRecords:
    """The latest record of each running request, by request id."""

    def __init__(self) -> None:
        self._by_id: dict[str, StepRecord] = {}

    def add(self, records: Mapping[str, StepRecord]) -> None:
        self._by_id.update(records)

    def pop(self, req_id: str) -> StepRecord | None:
        return self._by_id.pop(req_id, None)

    def drop(self, req_ids: Iterable[str]) -> None:
        for r in req_ids:
            self._by_id.pop(r, None)

    def __len__(self) -> int:
        return len(self._by_id)


# ---- applied to a worker's runner (vLLM's V1 GPUModelRunner; pipeline_parallel.py wraps its methods) ----------

def kept_and_drafts(runner: Any, output: Any) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """The last stage's kept tokens and new drafts per request, from its sampler output."""
    kept: dict[str, list[int]] = {}
    req_ids = getattr(output, "req_ids", None) or []
    sampled = getattr(output, "sampled_token_ids", None) or []
    for rid, toks in zip(req_ids, sampled):
        kept[rid] = [int(t) for t in toks]
    draft_lists, draft_ids = runner._get_draft_token_ids_cpu()
    drafts = {rid: [int(t) for t in d] for rid, d in zip(draft_ids, draft_lists)}
    return kept, drafts


def records_due(runner: Any, so: Any) -> dict[str, StepRecord]:
    """The records of the requests this step continues (checked against what the scheduler sends); the others
    (finished, new, resumed after preemption) are dropped."""
    records: StepRecords = runner._skyrl_pp_records
    records.drop(so.finished_req_ids)
    records.drop(r.req_id for r in so.scheduled_new_reqs)
    cached = so.scheduled_cached_reqs
    due = {}
    for i, rid in enumerate(cached.req_ids):
        rec = records.pop(rid)
        if rec is None or rid in cached.resumed_req_ids:
            continue
        new_tokens = cached.new_token_ids[i] if cached.new_token_ids else None
        check_next_step(rec, int(cached.num_computed_tokens[i]), new_tokens,
                             so.scheduled_spec_decode_tokens.get(rid, ()))
        runner._skyrl_pp_stats["checked"] += 1
        due[rid] = rec
    return due


def apply_to_cached_outputs(runner: Any, due: dict[str, StepRecord]) -> None:
    """Off the last stage, before vLLM updates its states: each request's cached outputs end with what the last
    stage kept. vLLM appends only the scheduler's one new token there, so a request that re-enters the
    persistent batch (add_request builds its row from these outputs, every other step under PP's batch queue)
    would get its drafts written at too early a position and run on stale tokens."""
    for rid, rec in due.items():
        if rec.kept:
            state = runner.requests[rid]
            start = rec.request.first_sample_position
            del state.output_token_ids[start - state.num_prompt_tokens:]
            state.output_token_ids.extend(rec.kept)


def apply_to_batch(runner: Any, due: dict[str, StepRecord], *, last_stage: bool) -> None:
    """After vLLM updated its states, before the inputs are prepared: the kept tokens in each request's row (vLLM
    writes its one new token over every accepted position off the last stage), and a hybrid model's accepted
    counts by request (vLLM resets them to 1 when a request re-enters the batch, never sets them off the last
    stage)."""
    last, hybrid = last_stage, runner.model_config.is_hybrid
    batch, stats = runner.input_batch, runner._skyrl_pp_stats
    for rid, rec in due.items():
        idx = batch.req_id_to_index[rid]
        if hybrid:
            if int(batch.num_accepted_tokens_cpu[idx]) != rec.num_accepted_tokens:
                stats["accepted_restored"] += 1
            batch.num_accepted_tokens_cpu[idx] = rec.num_accepted_tokens
        if not last and rec.kept:
            start = rec.request.first_sample_position
            batch.token_ids_cpu[idx, start:start + len(rec.kept)] = rec.kept
            stats["tokens_rewritten"] += len(rec.kept)
