"""The async modes: a driver thread keeps the engines generating the coming steps' batches while the policy trains.

`RolloutProducer` generates the batches in step order, one at a time, on a thread of the driver (the engines are
Ray actors: the thread only waits on them). It starts the batch of step `i + 1` once the weights the engines hold
are at most `max_staleness` policy updates behind the policy that will train it (version `i`), so no batch is ever
staler than the bound and nothing has to be dropped. one_step_off is `max_staleness=1` with the sync waiting for the
running batch; fully_async's sync does not wait: it holds the producer (no batch starts during the sync), pauses
the engines with their requests kept, pushes the new weights, labels them with the new version and resumes
(trainer.py); each token records the version that sampled it (vLLM's weight-version spans), and `staleness` turns
those into the batch's staleness. With `max_staleness=0` a batch starts only once the previous step's weights are
synced: the run is `sync`'s.

Evaluation and checkpoints run with the producer held and idle, so a checkpoint holds the batches already
generated (`pending_rollouts.pkl`: their rollouts, metrics and the policy version they started on) and no
half-generated one; a resumed run trains those first, as the unbroken run does. Regenerating them would need
weights from before the checkpoint's update, which the checkpoint does not keep.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyrl_mtp.rollout.sampling import token_versions

PENDING_FILE = "pending_rollouts.pkl"


@dataclass
class GeneratedBatch:
    step: int                    # the RL step (1-based) that trains it
    version: int                 # policy updates applied to the weights the engines started generating it with
    groups: list[Any]            # RolloutGroups kept for training
    metrics: dict[str, float]    # its rollout, reward and acceptance metrics
    seconds: dict[str, float] = field(default_factory=dict)   # its generation's phases (generate, reward)


def save_pending(directory: Path, batches: list[GeneratedBatch]) -> None:
    (Path(directory) / PENDING_FILE).write_bytes(pickle.dumps(list(batches), protocol=pickle.HIGHEST_PROTOCOL))


def load_pending(directory: Path) -> list[GeneratedBatch]:
    """The batches a checkpoint holds for its next steps, in order; none for a sync run's checkpoint."""
    path = Path(directory) / PENDING_FILE
    if not path.exists():
        return []
    batches = pickle.loads(path.read_bytes())   # the run's own checkpoint
    if not isinstance(batches, list) or not all(isinstance(b, GeneratedBatch) for b in batches):
        raise ValueError(f"{path} holds a {type(batches).__name__}, expected a list of GeneratedBatch")
    return batches


def staleness(rollouts: list[Any], trained_version: int, start_version: int) -> tuple[float, float, float]:
    """(mean, max, share sampled after the batch started) over the trained tokens (policy mask 1) of the policy
    updates between the weights that sampled each token and the policy that trains on it (`trained_version`). A
    rollout's tokens carry `info["weight_versions"]` spans (version, start, end); a rollout without them was
    sampled wholly by the weights the batch started with (`start_version`)."""
    total = weighted = newer = 0
    worst: int | None = None
    for r in rollouts:
        n = len(r.response_ids)
        spans = r.info.get("weight_versions") or [(start_version, 0, n)]
        try:
            versions = token_versions(spans, n)
        except ValueError as err:
            raise ValueError(f"weight-version spans {spans} do not cover the {n} response tokens: {err}") from None
        for version, trained in zip(versions, r.policy_mask()):
            if version > trained_version:
                raise ValueError(f"a token was sampled by version {version}, newer than the policy that trains it "
                                 f"({trained_version})")
            if trained:
                total += 1
                weighted += trained_version - version
                newer += version > start_version
                worst = max(worst or 0, trained_version - version)
    if total == 0:
        lag = float(trained_version - start_version)
        return lag, lag, 0.0
    return weighted / total, float(worst), newer / total


class RolloutProducer:
    """`generate(step_index, version) -> GeneratedBatch`: the batch of step `step_index + 1`, generated on the engines'
    current weights (`version` policy updates). Batches `next_index` .. `stop_index - 1` are produced; `ready` are
    batches generated before (a checkpoint's), handed out first."""

    def __init__(self, generate: Callable[[int, int], GeneratedBatch], *, next_index: int, stop_index: int,
                 version: int, max_staleness: int, ready: list[GeneratedBatch] | None = None):
        self._generate = generate
        self._next, self._stop, self.version, self.max_staleness = next_index, stop_index, version, max_staleness
        self._ready: list[GeneratedBatch] = list(ready or [])
        self._cond = threading.Condition()
        self._held = False
        self._closed = False
        self.generating = False   # a batch is being generated (its requests may be on the engines)
        self._busy, self._busy_since = 0.0, 0.0   # seconds spent generating, and when the running batch started
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _may_start(self) -> bool:
        return (not self._held and not self._closed and self._next < self._stop
                and self._next - self.version <= self.max_staleness)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._next >= self._stop or self._may_start())
                if not self._may_start():
                    self._cond.notify_all()   # a take() waiting for a batch that will not come
                    return
                index, version = self._next, self.version
                self.generating, self._busy_since = True, time.perf_counter()
            try:
                batch = self._generate(index, version)
            except BaseException as err:   # noqa: BLE001 - handed to the trainer, which raises it
                with self._cond:
                    self._busy += time.perf_counter() - self._busy_since
                    self._error, self.generating = err, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready.append(batch)
                self._next += 1
                self._busy += time.perf_counter() - self._busy_since
                self.generating = False
                self._cond.notify_all()

    def take(self) -> GeneratedBatch:
        """The next step's batch (blocks until it is generated); the producer's error is raised here."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready or self._error is not None or not self._thread.is_alive())
            if self._ready:
                return self._ready.pop(0)
            if self._error is not None:
                raise self._error
            raise RuntimeError("the rollout producer stopped before generating the batch asked for")

    @contextmanager
    def held(self) -> Iterator[None]:
        """No batch starts inside (a weight sync, evaluation, a checkpoint); one already running goes on."""
        with self._cond:
            self._held = True
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()

    def set_version(self, version: int) -> None:
        """The engines now hold `version` (after a sync): batches that waited for it may start."""
        with self._cond:
            self.version = version
            self._cond.notify_all()

    def wait_idle(self) -> None:
        """Until no batch is being generated (call it while held, or another may start)."""
        with self._cond:
            self._cond.wait_for(lambda: not self.generating)

    def busy_seconds(self) -> float:
        """Seconds spent generating so far (the running batch's included)."""
        with self._cond:
            return self._busy + (time.perf_counter() - self._busy_since if self.generating else 0.0)

    def ready_batches(self) -> list[GeneratedBatch]:
        with self._cond:
            return list(self._ready)

    def close(self) -> None:
        """Start nothing more; a batch being generated finishes (its result is dropped)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()
