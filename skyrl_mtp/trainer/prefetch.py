"""One step off: the next step's batch is generated in the background while the current step trains.

`RolloutPrefetch` runs one generation at a time on a worker thread of the driver: the engines are Ray actors, so
the thread only waits on them while the main thread drives the policy workers. The loop starts the next batch
before it trains and waits for it before the weight sync, so no weight changes under a running request.

A checkpoint holds the batch that was prefetched when it was written (`pending_rollouts.pkl`: the rollouts,
their metrics and the policy version that generated them), so a resumed run trains the batch an unbroken run
trains: regenerating it would need the weights from before the checkpoint's update, which the checkpoint does
not keep.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PENDING_FILE = "pending_rollouts.pkl"


@dataclass
class GeneratedBatch:
    step: int                    # the RL step (1-based) that trains it
    version: int                 # policy updates applied to the weights the engines generated it with
    groups: list[Any]            # RolloutGroups kept for training
    metrics: dict[str, float]    # its rollout, reward and acceptance metrics
    seconds: dict[str, float] = field(default_factory=dict)   # its generation's phases (generate, reward)


class RolloutPrefetch:
    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future | None = None

    @property
    def running(self) -> bool:
        return self._future is not None

    def start(self, generate: Callable[[], GeneratedBatch]) -> None:
        if self._future is not None:
            raise RuntimeError("a batch is already being prefetched: wait for it before starting the next")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-prefetch")
        self._future = self._pool.submit(generate)

    def wait(self) -> GeneratedBatch:
        """The prefetched batch (blocks until it is generated); its generation's error is raised here."""
        if self._future is None:
            raise RuntimeError("no batch is being prefetched")
        future, self._future = self._future, None
        return future.result()

    def drain(self) -> None:
        """After a failure of the step: let a running generation finish, dropping its result or error."""
        if self._future is not None:
            future, self._future = self._future, None
            try:
                future.result()
            except Exception:   # noqa: BLE001 - the step's own error is the one being raised
                pass

    def close(self) -> None:
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def save_pending(directory: Path, batch: GeneratedBatch) -> None:
    (Path(directory) / PENDING_FILE).write_bytes(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))


def load_pending(directory: Path) -> GeneratedBatch | None:
    """The batch a checkpoint holds for its next step, None when it holds none (a sync run's checkpoint)."""
    path = Path(directory) / PENDING_FILE
    if not path.exists():
        return None
    batch = pickle.loads(path.read_bytes())   # the run's own checkpoint
    if not isinstance(batch, GeneratedBatch):
        raise ValueError(f"{path} holds a {type(batch).__name__}, expected a GeneratedBatch")
    return batch
