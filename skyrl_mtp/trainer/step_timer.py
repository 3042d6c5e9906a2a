"""Wall-clock timing of the phases of one RL step, reported as `timing/<phase>_s`.

Phases may nest (reward scoring happens inside generation): a phase's time is exclusive, the
time spent in a phase opened inside it counts for the inner one only, so the phases add up to
the step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StepTimer:
    def __init__(self, clock=time.perf_counter) -> None:
        self.totals: dict[str, float] = {}
        self._clock = clock
        self._open: list[tuple[str, float]] = []   # (phase, start of its current uninterrupted stretch)

    def _add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        now = self._clock()
        if self._open:
            outer, since = self._open[-1]
            self._add(outer, now - since)
        self._open.append((name, now))
        try:
            yield
        finally:
            end = self._clock()
            _, since = self._open.pop()
            self._add(name, end - since)
            if self._open:
                self._open[-1] = (self._open[-1][0], end)

    def metrics(self) -> dict[str, float]:
        out = {f"timing/{name}_s": round(value, 4) for name, value in self.totals.items()}
        out["timing/step_s"] = round(sum(self.totals.values()), 4)
        return out
