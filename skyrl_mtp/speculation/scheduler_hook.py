"""The engine-core half of adaptive speculation: vLLM's scheduler chooses the k of each step.

Why this exists: vLLM's dynamic speculative decoding already picks K in the scheduler
(`SchedulerOutput.num_spec_tokens_to_schedule`), from a fixed batch-size table. Choosing it here from
measurements (adaptive_speculation.SpeculationPolicy) rather than in the worker lets the engine core know
when a step drafted nothing. vLLM's engine core otherwise fetches drafts from the worker after every step
once speculation is configured (`EngineCore.post_step` -> `take_draft_token_ids`), a round trip through
the multi-process executor that a no-spec engine never makes; at k = 0 it is skipped here, so a step that
drafts nothing costs what a no-spec step costs. The scheduler also times whole steps (one schedule() to
the next: round trips and output processing included) for the cost model, and reads acceptance from what
was verified, and what the verified drafts saved (SpeculationPolicy.credit_verified). And it memoizes a
function vLLM's scheduler recomputes per request and step once a drafter is configured (kv_replay_cache),
so a step that drafts nothing is also scheduled as fast as a no-spec one.

Installed with the engine argument `scheduler_cls` (EngineConfig sets it when adaptive_speculation is
on); the worker half (adaptive_speculation.install) follows the k it is sent.
"""

from __future__ import annotations

import inspect
import os
import time
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore

from skyrl_mtp.speculation import trace as policy_trace
from skyrl_mtp.speculation.policy import (
    AdaptiveSpeculationError,
    SpeculationPolicy,
    _require,
    explore_budget_from_env,
)
from skyrl_mtp.vllm_patches import kv_replay_cache

IDLE_GAP_S = 0.002


@dataclass
class _Step:
    t0: float
    num_tokens: int
    batch: int
    k: int
    timed: bool     # a decode-only step at the same k as the previous one (CostModel.observe)
    settle: int = -1   # a decode-only step settling after an exploration: its position (observe_settle)
    t_end: float = 0.0


class AdaptiveSpeculationScheduler(Scheduler):
    """vLLM's synchronous scheduler with k per step chosen by a SpeculationPolicy."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        spec = vllm_config.speculative_config
        _require(spec is not None and bool(getattr(spec, "num_speculative_tokens_per_batch_size", None)),
                 "adaptive speculation's scheduler needs an engine with speculative_config."
                 "num_speculative_tokens_per_batch_size (dynamic speculative decoding)")
        if vllm_config.scheduler_config.async_scheduling:
            raise AdaptiveSpeculationError(
                "adaptive speculation needs async_scheduling=False (with async scheduling the engine core "
                "never sees the drafts, and its scheduler would not run this class's choice)")
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size != 1:
            raise AdaptiveSpeculationError(f"adaptive speculation needs pipeline_parallel_size=1, got "
                                           f"{par.pipeline_parallel_size}")
        _require(isinstance(getattr(self, "num_spec_tokens", None), int) and self.num_spec_tokens >= 1,
                 "vLLM's Scheduler has no int `num_spec_tokens` (the engine's k)")
        _require("self.scheduler.reset_prefix_cache(" in inspect.getsource(EngineCore.reset_prefix_cache),
                 "EngineCore.reset_prefix_cache no longer calls the scheduler's (a weight sync would not reach "
                 "the acceptance estimate)")
        _require(isinstance(getattr(self, "max_num_running_reqs", None), int),
                 "vLLM's Scheduler has no int `max_num_running_reqs` (the engine's max_num_seqs)")
        _require(isinstance(getattr(self, "running", None), list) and isinstance(getattr(self, "max_model_len", None), int),
                 "vLLM's Scheduler has no list `running` and int `max_model_len` (read for the requests that stay)")
        # (not `policy`: vLLM's Scheduler keeps its SchedulingPolicy, FCFS or priority, under that name)
        check_own_names_free(self)
        self.speculation = SpeculationPolicy(k_max=self.num_spec_tokens, max_batch=self.max_num_running_reqs,
                                             explore_budget=explore_budget_from_env(os.environ))
        # trainer.mtp.policy_trace_dir: every call to the policy, for an exact replay (policy_trace.py)
        self._trace = policy_trace.writer_from_env(os.environ, self.speculation)
        self._scheduled: Any = None   # the SchedulerOutput the policy is choosing k for (_staying reads it)
        self._staying_seen: int | None = None   # what _staying answered for it, if the policy asked
        self._step: _Step | None = None
        self._finished: _Step | None = None
        self._prev_k = -1
        self.fetches_skipped = 0
        install_post_step_guard()
        kv_replay_cache.install()

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        self._time_finished_step(t0)
        out = super().schedule(*args, **kwargs)
        batch = len(out.num_scheduled_tokens)
        if not batch:
            self._step, self._prev_k = None, -1
            return out
        # decode-only: every request is scheduled 1 + its drafts tokens, never fewer (vLLM trims drafts to
        # what it schedules), so comparing the totals suffices; timed when also at the k of the step before
        decode_only = not out.scheduled_new_reqs and out.total_num_scheduled_tokens == batch + sum(
            len(d) for d in out.scheduled_spec_decode_tokens.values())
        self._scheduled, self._staying_seen = out, None
        k = self.speculation.choose(batch, decode_only, self._staying)
        self._scheduled = None
        if self._trace is not None:
            self._trace.choose(batch, decode_only, k, self._staying_seen)
        out.num_spec_tokens_to_schedule = k
        settle = self.speculation.settling if decode_only else -1
        timed = k == self._prev_k and decode_only and settle < 0   # settling steps stay out of k = 0's fit
        self._step = _Step(t0, int(out.total_num_scheduled_tokens), batch, k, timed, settle)
        self._prev_k = k
        return out

    def _staying(self) -> int:
        """How many of the running requests this step leaves short of their length cap (max_tokens, or the
        model's length), counting every draft it verifies as accepted: they may run at the next step, unless an
        end-of-sequence token ends them. The others end with this step."""
        spec, cap = self._scheduled.scheduled_spec_decode_tokens, self.max_model_len
        n = 0
        try:
            for req in self.running:
                emitted = 1 + len(spec.get(req.request_id, ()))
                if req.num_output_tokens + emitted < req.max_tokens and req.num_tokens + emitted < cap:
                    n += 1
        except AttributeError as e:
            raise AdaptiveSpeculationError(f"vLLM's Request no longer has what counts its tokens to its cap: {e}") from e
        self._staying_seen = n
        return n

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        spec = scheduler_output.scheduled_spec_decode_tokens
        if spec:
            index, sampled = model_runner_output.req_id_to_index, model_runner_output.sampled_token_ids
            drafts, accepted = [], []
            for rid, tokens in spec.items():
                i = index.get(rid)
                if i is None or i >= len(sampled):
                    continue
                drafts.append(len(tokens))
                accepted.append(max(0, min(len(sampled[i]) - 1, len(tokens))))
            batch = len(scheduler_output.num_scheduled_tokens)
            self.speculation.observe_verified(batch, drafts, accepted)
            if self._trace is not None:
                self._trace.verified(batch, drafts, accepted)
        return super().update_from_output(scheduler_output, model_runner_output)

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        """Every weight sync ends with a prefix-cache reset (EngineClient.sync_weights, StepSync): the
        acceptance seen so far was the old weights', so the new ones' drafts soon outweigh it."""
        self.speculation.on_new_weights()
        if self._trace is not None:
            self._trace.new_weights()
        return super().reset_prefix_cache(*args, **kwargs)

    def drafted_nothing(self) -> bool:
        return self._step is not None and self._step.k == 0

    def end_step(self) -> None:
        step, self._step = self._step, None
        if step is not None and (step.timed or step.settle >= 0) and self.speculation.timing_valid:
            step.t_end = time.perf_counter()
            self._finished = step

    def _time_finished_step(self, now: float) -> None:
        """A step costs from its schedule() to the next one: its output processing between steps (per
        token emitted, so more per step when drafts are accepted) is part of what drafting trades. A gap
        longer than the step itself means the engine went idle (no requests), and the step is not timed."""
        step, self._finished = self._finished, None
        if step is not None and now - step.t_end <= 2.0 * (step.t_end - step.t0) + IDLE_GAP_S:
            seconds = now - step.t0
            if step.settle >= 0:
                self.speculation.observe_settle(step.settle, step.num_tokens, step.batch, seconds)
                if self._trace is not None:
                    self._trace.settled(step.settle, step.num_tokens, step.batch, seconds)
            else:
                self.speculation.cost.observe(step.num_tokens, step.batch, step.k, seconds)
                if self._trace is not None:
                    self._trace.timed(step.num_tokens, step.batch, step.k, seconds)


# what this class adds to vLLM's Scheduler: attributes set in __init__, and methods
OWN_ATTRIBUTES = ("speculation", "_trace", "_scheduled", "_staying_seen", "_step", "_finished", "_prev_k",
                  "fetches_skipped")
OWN_METHODS = ("drafted_nothing", "end_step", "_time_finished_step", "_staying")


def check_own_names_free(scheduler: Any) -> None:
    """vLLM's scheduler (after its __init__) uses none of the names this class adds: one that it did would be
    overwritten here, as `policy` once was (vLLM's SchedulingPolicy, read by its preemption)."""
    for name in OWN_ATTRIBUTES:
        _require(not hasattr(scheduler, name), f"vLLM's Scheduler now has an attribute `{name}`")
    for name in OWN_METHODS:
        _require(not hasattr(Scheduler, name), f"vLLM's Scheduler now has a method `{name}`")


def install_post_step_guard() -> None:
    """Wrap EngineCore.post_step (once per process) so that, with this scheduler, a step that drafted
    nothing does not fetch drafts from the worker, and every step's end is timed. Other schedulers pass
    straight through. Also adds the engine-core utility that reports the policy's state."""
    orig = EngineCore.post_step
    if getattr(orig, "_skyrl_adaptive", False):
        return
    got = tuple(inspect.signature(orig).parameters)
    _require(got == ("self", "model_executed"), f"EngineCore.post_step parameters are {got}, expected "
                                                "('self', 'model_executed')")
    try:
        src = inspect.getsource(orig)
    except (OSError, TypeError) as e:
        raise AdaptiveSpeculationError(f"cannot read EngineCore.post_step's source to check it: {e}") from e
    _require("take_draft_token_ids" in src and "update_draft_token_ids" in src,
             "EngineCore.post_step no longer fetches drafts with take_draft_token_ids / update_draft_token_ids")

    def post_step(self: Any, model_executed: bool) -> None:
        sched = self.scheduler
        if not isinstance(sched, AdaptiveSpeculationScheduler):
            return orig(self, model_executed)
        try:
            if model_executed and sched.drafted_nothing():
                # the worker proposed no drafts: the fetch would return empty lists, and the scheduler
                # already cleared the scheduled requests' drafts when it scheduled them
                sched.fetches_skipped += 1
                return None
            return orig(self, model_executed)
        finally:
            sched.end_step()

    post_step._skyrl_adaptive = True  # type: ignore[attr-defined]
    EngineCore.post_step = post_step
    _require(not hasattr(EngineCore, POLICY_STATS_UTILITY), f"EngineCore already has a `{POLICY_STATS_UTILITY}`")
    setattr(EngineCore, POLICY_STATS_UTILITY, _policy_stats)


POLICY_STATS_UTILITY = "skyrl_adaptive_policy_stats"


def _policy_stats(self: Any) -> dict[str, Any] | None:
    """An engine-core utility (AsyncLLM.engine_core.call_utility_async(POLICY_STATS_UTILITY)): the state
    of the policy that chooses k (acceptance it decides on, k histogram, calibrated buckets) and vLLM's own
    scheduling policy (`scheduling_policy`: "fcfs" or "priority"), or None when this engine core's scheduler
    is not the adaptive one."""
    sched = self.scheduler
    if not isinstance(sched, AdaptiveSpeculationScheduler):
        return None
    return {**sched.speculation.stats(), "fetches_skipped": sched.fetches_skipped,
            "scheduling_policy": getattr(getattr(sched, "policy", None), "value", None),
            "kv_replay_cache": kv_replay_cache.stats()}
