"""Timing schedulers for engine_schedule_time.py, imported by name in vLLM's engine core process.

Each times, per engine step, vLLM's own `Scheduler.schedule` and the whole `schedule()` of the engine's
scheduler class (for auto k that adds the speculation policy's choice and step timing), as thread CPU
time, and writes its running sums to `$SKYRL_BENCH_SCHED_OUT.<pid>` (JSON) at every prefix-cache reset,
which the benchmark's driver asks for after each rollout. Only plain decode steps count: no prompt
tokens, no drafts verified, none proposed (k = 0), and at least `$SKYRL_BENCH_SCHED_MIN_BATCH` sequences.

Each also times whole steps, from one `schedule()` to the next, in the engine core's thread (which runs
the model too: the CPU worker runs in the EngineCore process, and the benchmark gives torch one thread, as
a one-CPU Ray actor does), per kind: those plain decode steps (`step_s`), and prompt steps (`prompt_s`:
new requests scheduled, no drafts either way, with `prompt_tokens` their scheduled tokens). A step that
drafts or verifies, or the last one before a prefix-cache reset (it would carry the reset), counts in
neither.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import vllm.v1.core.kv_cache_coordinator as kcc
from vllm.v1.core.sched.scheduler import Scheduler

from skyrl_mtp.speculation.scheduler_hook import AdaptiveSpeculationScheduler

_vllm_schedule = Scheduler.schedule


def _timed_vllm_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
    c0 = time.thread_time()
    out = _vllm_schedule(self, *args, **kwargs)
    self._bench_vllm_s = time.thread_time() - c0
    return out


Scheduler.schedule = _timed_vllm_schedule   # this benchmark's engine core only


class _Timer:
    """The timing half of both schedulers below (first in their bases, so its methods wrap the scheduler's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bench = {"steps": 0, "vllm_s": 0.0, "total_s": 0.0, "rounds": 0, "step_s": 0.0,
                       "prompt_steps": 0, "prompt_s": 0.0, "prompt_tokens": 0}
        self._bench_min_batch = int(os.environ.get("SKYRL_BENCH_SCHED_MIN_BATCH", "1"))
        self._bench_open: dict[str, Any] | None = None   # the step in flight, counted once the next one starts

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        c0 = time.thread_time()
        self._bench_close(c0)
        out = super().schedule(*args, **kwargs)   # type: ignore[misc]
        total_s = time.thread_time() - c0
        batch = len(out.num_scheduled_tokens)
        if self._drafted(out) or out.scheduled_spec_decode_tokens:
            return out
        if batch >= self._bench_min_batch and not out.scheduled_new_reqs and out.total_num_scheduled_tokens == batch:
            self._bench_open = {"kind": "step", "start": c0, "vllm_s": self._bench_vllm_s, "total_s": total_s}
        elif out.scheduled_new_reqs:
            self._bench_open = {"kind": "prompt", "start": c0, "tokens": int(out.total_num_scheduled_tokens)}
        return out

    def _bench_close(self, now: float) -> None:
        step, self._bench_open = self._bench_open, None
        if step is None:
            return
        b = self._bench
        if step["kind"] == "step":
            b["steps"] += 1
            b["vllm_s"] += step["vllm_s"]
            b["total_s"] += step["total_s"]
            b["step_s"] += now - step["start"]
        else:
            b["prompt_steps"] += 1
            b["prompt_tokens"] += step["tokens"]
            b["prompt_s"] += now - step["start"]

    def _drafted(self, out: Any) -> bool:
        return False

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        self._bench_open = None   # the rollout's last step: its time would include this reset
        self._bench["rounds"] += 1
        memo = getattr(kcc.replay_boundaries, "cache_info", None)
        info = memo() if memo else None
        doc = {**self._bench, "memo_hits": info.hits if info else None}
        with open(f"{os.environ['SKYRL_BENCH_SCHED_OUT']}.{os.getpid()}", "w") as f:
            json.dump(doc, f)
        return super().reset_prefix_cache(*args, **kwargs)   # type: ignore[misc]


class TimedScheduler(_Timer, Scheduler):
    """vLLM's scheduler, as a no-spec engine runs it."""


class TimedAdaptive(_Timer, AdaptiveSpeculationScheduler):
    """Auto k's scheduler as shipped (vLLM's replay boundaries memoized: kv_replay_cache)."""

    def _drafted(self, out: Any) -> bool:
        return out.num_spec_tokens_to_schedule > 0


class TimedAdaptiveUnmemoized(TimedAdaptive):
    """Auto k's scheduler with vLLM's replay_boundaries computed afresh on every call, as vLLM does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        kcc.replay_boundaries = getattr(kcc.replay_boundaries, "__wrapped__", kcc.replay_boundaries)


class TimedAdaptiveNoPolicy(TimedAdaptive):
    """Auto k's engine and scheduler with the speculation policy's code taken out: k = 0 on every step (the
    policy's choice is not asked) and no step timing for its cost model. The rest of the adaptive scheduler
    (its schedule() around vLLM's, the post-step guard, the memo) and the worker's hook run as shipped."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.speculation.choose = lambda batch, steady=True, staying=None: 0

    def _time_finished_step(self, now: float) -> None:
        return None
