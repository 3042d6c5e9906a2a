"""Where an engine step's time goes inside vLLM's model runner: wall time per runner phase.

Why this exists: a speculative engine that drafts nothing in a step (adaptive speculation at k = 0) still
runs vLLM's speculative runner, which does some per-step work a no-spec runner skips (spec-decode metadata
in input preparation, drafter bookkeeping after sampling). Rollout timings alone cannot tell that cost
from the engine-to-engine spread of a shared machine; timing the runner's phases in both engines can.

`install(runner)` wraps the runner instance's phase methods (instance attributes: the class and other
runners are untouched; wrappers keep the wrapped signature, which adaptive_speculation.check_runner
inspects) and counts calls and seconds per phase. A phase the runner no longer has raises
PhaseTimerError naming it. Phases nest: execute_model holds _prepare_inputs and _model_forward;
sample_tokens holds _sample, propose_draft_token_ids and _bookkeeping_sync.
"""

from __future__ import annotations

import functools
import time
from typing import Any

PHASES = ("execute_model", "_prepare_inputs", "_model_forward", "sample_tokens", "_sample",
          "propose_draft_token_ids", "_bookkeeping_sync")


class PhaseTimerError(RuntimeError):
    pass


class PhaseTimer:
    def __init__(self, runner: Any, phases: tuple[str, ...] = PHASES):
        missing = [p for p in phases if not callable(getattr(runner, p, None))]
        if missing:
            raise PhaseTimerError(f"vLLM's {type(runner).__name__} has no {missing}: runner_phase_timer's phase "
                                  "list must follow this vLLM version")
        self.calls = {p: 0 for p in phases}
        self.seconds = {p: 0.0 for p in phases}
        for p in phases:
            setattr(runner, p, self._timed(p, getattr(runner, p)))

    def _timed(self, phase: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - t0
                self.calls[phase] += 1
        return timed

    def snapshot(self) -> dict[str, list[float]]:
        return {p: [self.calls[p], self.seconds[p]] for p in self.calls}


def install(runner: Any) -> PhaseTimer:
    timer = getattr(runner, "_skyrl_phase_timer", None)
    if timer is None:
        timer = PhaseTimer(runner)
        runner._skyrl_phase_timer = timer
    return timer


def ms_per_step(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, float]:
    """Milliseconds per engine step (one execute_model call) of each phase between two snapshots; a phase
    called in none of those steps reads 0."""
    steps = after["execute_model"][0] - before["execute_model"][0]
    if steps <= 0:
        raise ValueError("no engine step between the two snapshots")
    return {p: 1000.0 * (after[p][1] - before[p][1]) / steps for p in after}
