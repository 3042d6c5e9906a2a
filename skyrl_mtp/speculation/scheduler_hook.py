"""The engine-core half of auto k: vLLM's scheduler asks the speculation policy for each step's k.

Why this exists: vLLM's dynamic speculative decoding already lets the scheduler set each step's k
(`SchedulerOutput.num_spec_tokens_to_schedule`), from a fixed table of batch sizes. This scheduler sets it
from the policy instead (policy.py), and feeds the policy what only the engine core sees: each step's batch
and kind, its time (from its schedule() to the next one's, output processing included; not timed when the
engine went idle in between), the drafts verified and accepted, and the weight syncs (each ends with a
prefix-cache reset). Installed with vLLM's `scheduler_cls` engine argument (EngineConfig sets it); its
settings come in vLLM's config (settings.py); the worker half (worker_hook.py) follows the k it sends.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore

from skyrl_mtp.speculation.policy import SpeculationPolicy
from skyrl_mtp.speculation.settings import AdaptiveSpeculationError, SpeculationSettings, require
from skyrl_mtp.speculation.trace import PolicyTraceWriter

STATS_UTILITY = "skyrl_speculation_stats"   # an EngineCore utility: call_utility_async(STATS_UTILITY)
OWN_ATTRIBUTES = ("speculation", "_trace", "_t0", "_t_end")


class AdaptiveSpeculationScheduler(Scheduler):
    """vLLM's synchronous scheduler with each step's k chosen by a SpeculationPolicy."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        settings = SpeculationSettings.from_vllm_config(vllm_config)
        spec = vllm_config.speculative_config
        require(spec is not None and bool(getattr(spec, "num_speculative_tokens_per_batch_size", None)),
                "auto k's scheduler needs speculative_config.num_speculative_tokens_per_batch_size (dynamic "
                "speculative decoding)")
        if vllm_config.scheduler_config.async_scheduling:
            raise AdaptiveSpeculationError("auto k needs async_scheduling=False (with async scheduling the engine "
                                           "core never sees the drafts)")
        require(isinstance(getattr(self, "num_spec_tokens", None), int) and self.num_spec_tokens >= 1,
                "vLLM's Scheduler has no int `num_spec_tokens` (the engine's k)")
        require("self.scheduler.reset_prefix_cache(" in inspect.getsource(EngineCore.reset_prefix_cache),
                "EngineCore.reset_prefix_cache no longer calls the scheduler's (a weight sync would not reach "
                "the acceptance estimate)")
        for name in OWN_ATTRIBUTES:   # (vLLM's Scheduler keeps its own `policy`: FCFS or priority)
            require(not hasattr(self, name), f"vLLM's Scheduler now has an attribute `{name}`")
        self.speculation = SpeculationPolicy(self.num_spec_tokens, settings.explore_budget)
        self._trace = None if settings.trace_dir is None else PolicyTraceWriter(settings.trace_dir, self.speculation)
        self._t0: float | None = None      # when the step being timed was scheduled
        self._t_end = 0.0                  # when its output was processed
        existing = getattr(EngineCore, STATS_UTILITY, None)
        require(existing in (None, _stats), f"EngineCore already has a `{STATS_UTILITY}`")
        setattr(EngineCore, STATS_UTILITY, _stats)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        now = time.perf_counter()
        if self._t0 is not None:   # the step before: timed unless the engine sat idle after it
            seconds = now - self._t0
            if now - self._t_end <= self._t_end - self._t0:
                self.speculation.step_seconds(seconds)
                if self._trace is not None:
                    self._trace.step_seconds(seconds)
        out = super().schedule(*args, **kwargs)
        batch = len(out.num_scheduled_tokens)
        self._t0 = now if batch else None
        if not batch:
            return out
        # decode only: each request is scheduled 1 + its drafts tokens (vLLM trims drafts to what it schedules)
        steady = not out.scheduled_new_reqs and out.total_num_scheduled_tokens == batch + sum(
            len(d) for d in out.scheduled_spec_decode_tokens.values())
        out.num_spec_tokens_to_schedule = k = self.speculation.choose(batch, steady)
        if self._trace is not None:
            self._trace.choose(batch, steady, k)
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        spec, drafts, accepted = scheduler_output.scheduled_spec_decode_tokens, [], []
        if spec:
            index, sampled = model_runner_output.req_id_to_index, model_runner_output.sampled_token_ids
            for rid, tokens in spec.items():
                i = index.get(rid)
                if tokens and i is not None and i < len(sampled):
                    drafts.append(len(tokens))
                    accepted.append(max(0, min(len(sampled[i]) - 1, len(tokens))))
        if drafts:
            batch = len(scheduler_output.num_scheduled_tokens)
            self.speculation.observe_verified(batch, drafts, accepted)
            if self._trace is not None:
                self._trace.verified(batch, drafts, accepted)
        out = super().update_from_output(scheduler_output, model_runner_output)
        self._t_end = time.perf_counter()
        return out

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        """Every weight sync ends with a prefix-cache reset: the acceptance seen so far was the old head's."""
        self.speculation.on_new_weights()
        if self._trace is not None:
            self._trace.new_weights()
        return super().reset_prefix_cache(*args, **kwargs)


def _stats(self: Any) -> dict[str, Any] | None:
    """EngineCore utility: the policy's state (policy.stats()) and vLLM's own scheduling policy, or None when
    this engine core's scheduler is not the adaptive one."""
    sched = self.scheduler
    if not isinstance(sched, AdaptiveSpeculationScheduler):
        return None
    return {**sched.speculation.stats(), "scheduling_policy": getattr(getattr(sched, "policy", None), "value", None)}
