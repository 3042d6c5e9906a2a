"""Wall-clock timing of the phases of one RL step, reported as `timing/<phase>_s`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StepTimer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        out = {f"timing/{name}_s": round(value, 4) for name, value in self.totals.items()}
        out["timing/step_s"] = round(sum(self.totals.values()), 4)
        return out
