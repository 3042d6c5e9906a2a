"""Draft-acceptance and throughput metrics over explicit windows (train generation, eval generation).

vLLM exposes cumulative Prometheus counters per engine process. A window takes snapshots of
those counters (summed over engines) when it opens, pauses, resumes and closes, and reports the
deltas accumulated while it was open and not paused, so train and eval rollouts never mix and
time spent outside generation (rewards, weight sync) does not dilute throughput.

A pause may take its snapshot later (`snapshot_later`): the caller pauses a window when generation stops
(the rewards are computed next), so the engines' counters cannot change until it generates again, and the
read can run beside the rewards instead of before them; it is resolved when the window resumes or stops.

The logic here is pure: `SpecMetricsWindow` takes snapshot callables and a clock, so it is tested
with fake counters; `counters_from_vllm_metrics` turns vLLM's metric objects into `SpecCounters`, and
`read_counters` reads the same from a Prometheus registry directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

VLLM_NUM_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
VLLM_NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
VLLM_GENERATION_TOKENS = "vllm:generation_tokens"


def _pad_add(a: tuple[float, ...], b: tuple[float, ...], sign: float) -> tuple[float, ...]:
    n = max(len(a), len(b))
    a = a + (0.0,) * (n - len(a))
    b = b + (0.0,) * (n - len(b))
    return tuple(x + sign * y for x, y in zip(a, b))


@dataclass(frozen=True)
class SpecCounters:
    """Cumulative counters of one engine, or a sum/difference of several snapshots."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: tuple[float, ...] = ()
    generated_tokens: float = 0.0
    # adaptive speculation (trainer.mtp.num_speculative_tokens=auto): engine steps decided, and the sum
    # of the k chosen at them (mean k per step = speculation_k_sum / speculation_steps)
    speculation_steps: float = 0.0
    speculation_k_sum: float = 0.0
    speculation_k_hist: tuple[float, ...] = ()   # engine steps per k run (0..k_max)
    # the engine core's policy: its steps per k it chose, exploration aside (a probe, challenge or
    # calibration step counts at the k it would otherwise have run; warm-up steps, before any choice, not
    # at all), and how many steps explored
    speculation_model_k_hist: tuple[float, ...] = ()
    speculation_explored_steps: float = 0.0
    # engine seconds the verified drafts saved against not drafting, at the policy's fitted step costs
    speculation_seconds_saved: float = 0.0

    def _combine(self, other: SpecCounters, sign: float) -> SpecCounters:
        return SpecCounters(
            num_drafts=self.num_drafts + sign * other.num_drafts,
            num_draft_tokens=self.num_draft_tokens + sign * other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens + sign * other.num_accepted_tokens,
            accepted_per_pos=_pad_add(self.accepted_per_pos, other.accepted_per_pos, sign),
            generated_tokens=self.generated_tokens + sign * other.generated_tokens,
            speculation_steps=self.speculation_steps + sign * other.speculation_steps,
            speculation_k_sum=self.speculation_k_sum + sign * other.speculation_k_sum,
            speculation_k_hist=_pad_add(self.speculation_k_hist, other.speculation_k_hist, sign),
            speculation_model_k_hist=_pad_add(self.speculation_model_k_hist, other.speculation_model_k_hist, sign),
            speculation_explored_steps=self.speculation_explored_steps + sign * other.speculation_explored_steps,
            speculation_seconds_saved=self.speculation_seconds_saved + sign * other.speculation_seconds_saved,
        )

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, 1.0)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, -1.0)


def sum_counters(parts: Iterable[SpecCounters]) -> SpecCounters:
    total = SpecCounters()
    for p in parts:
        total = total + p
    return total


def read_counters(registry: Any = None) -> SpecCounters:
    """This process's vLLM counters (counters_from_vllm_metrics of vLLM's `get_metrics_snapshot()`), read off
    the five metrics it needs alone (prometheus_client's `restricted_registry`): vLLM's snapshot converts every
    metric it registers, histograms with all their buckets included, ~1.7 ms a read in an engine's process,
    and each RL step's generate phase reads several times. `registry` defaults to prometheus_client's."""
    if registry is None:
        from prometheus_client import REGISTRY as registry
    names = (VLLM_NUM_DRAFTS, VLLM_NUM_DRAFT_TOKENS, VLLM_NUM_ACCEPTED_TOKENS, VLLM_GENERATION_TOKENS,
             VLLM_ACCEPTED_PER_POS)
    scalars = dict.fromkeys(names[:4], 0.0)
    per_pos: dict[int, int] = {}
    for metric in registry.restricted_registry([n + "_total" for n in names]).collect():
        for sample in metric.samples:
            if sample.name != metric.name + "_total":
                continue
            if metric.name == VLLM_ACCEPTED_PER_POS:   # one counter per position (and per engine index)
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0) + int(sample.value)
            elif metric.name in scalars:
                scalars[metric.name] += float(int(sample.value))
    return SpecCounters(num_drafts=scalars[VLLM_NUM_DRAFTS], num_draft_tokens=scalars[VLLM_NUM_DRAFT_TOKENS],
                        num_accepted_tokens=scalars[VLLM_NUM_ACCEPTED_TOKENS],
                        accepted_per_pos=tuple(float(per_pos.get(i, 0)) for i in range(max(per_pos, default=-1) + 1)),
                        generated_tokens=scalars[VLLM_GENERATION_TOKENS])


def counters_from_vllm_metrics(metrics: Iterable[Any]) -> SpecCounters:
    """Sum vLLM metric objects (`vllm.v1.metrics.reader` Counter/Vector: .name, .value / .values)
    into `SpecCounters`; label sets of the same name (e.g. several engine indices) are added."""
    scalars = {VLLM_NUM_DRAFTS: 0.0, VLLM_NUM_DRAFT_TOKENS: 0.0, VLLM_NUM_ACCEPTED_TOKENS: 0.0,
               VLLM_GENERATION_TOKENS: 0.0}
    per_pos: tuple[float, ...] = ()
    for m in metrics:
        name = getattr(m, "name", None)
        if name in scalars:
            scalars[name] += float(m.value)
        elif name == VLLM_ACCEPTED_PER_POS:
            per_pos = _pad_add(per_pos, tuple(float(v) for v in m.values), 1.0)
    return SpecCounters(
        num_drafts=scalars[VLLM_NUM_DRAFTS],
        num_draft_tokens=scalars[VLLM_NUM_DRAFT_TOKENS],
        num_accepted_tokens=scalars[VLLM_NUM_ACCEPTED_TOKENS],
        accepted_per_pos=per_pos,
        generated_tokens=scalars[VLLM_GENERATION_TOKENS],
    )


def summarize_window(delta: SpecCounters, label: str, num_speculative_tokens: int,
                     active_seconds: float) -> dict[str, float]:
    """Metrics of one window from its counter deltas (pure).

    acceptance rate = accepted / draft tokens; per-position rate i = accepted at position i / drafts;
    mean acceptance length = 1 + accepted / drafts (tokens emitted per target step); with no drafts
    the rates are 0 and the mean acceptance length is 1.
    """
    p = f"rollout/{label}/"
    drafts = delta.num_drafts
    out = {
        p + "draft_acceptance_rate": delta.num_accepted_tokens / delta.num_draft_tokens
        if delta.num_draft_tokens > 0 else 0.0,
        p + "mean_acceptance_length": 1.0 + delta.num_accepted_tokens / drafts if drafts > 0 else 1.0,
        p + "num_drafts": float(drafts),
        p + "num_draft_tokens": float(delta.num_draft_tokens),
        p + "num_accepted_tokens": float(delta.num_accepted_tokens),
        p + "generated_tokens": float(delta.generated_tokens),
        p + "tokens_per_s": delta.generated_tokens / active_seconds if active_seconds > 0 else 0.0,
        p + "active_seconds": float(active_seconds),
    }
    for i in range(1, num_speculative_tokens + 1):
        accepted_i = delta.accepted_per_pos[i - 1] if i <= len(delta.accepted_per_pos) else 0.0
        out[p + f"draft_acceptance_rate_pos_{i}"] = accepted_i / drafts if drafts > 0 else 0.0
    if delta.speculation_steps > 0:   # adaptive k: the mean number of drafts chosen per engine step
        out[p + "speculation_k_mean"] = delta.speculation_k_sum / delta.speculation_steps
        for k, n in enumerate(delta.speculation_k_hist):
            out[p + f"speculation_k_share_{k}"] = n / delta.speculation_steps
    decided = sum(delta.speculation_model_k_hist)
    if decided > 0:   # what the policy chose, exploration aside (the trainer's idle-head cadence reads these)
        for k, n in enumerate(delta.speculation_model_k_hist):
            out[p + f"speculation_model_k_share_{k}"] = n / decided
    if delta.speculation_steps > 0 and delta.speculation_model_k_hist:
        out[p + "speculation_explored_share"] = min(1.0, delta.speculation_explored_steps / delta.speculation_steps)
    if delta.speculation_steps > 0:   # summed over engines (the trainer's head-training credit reads it)
        out[p + "speculation_seconds_saved"] = delta.speculation_seconds_saved
    return out


class SpecMetricsWindow:
    """start(label) -> [pause() / resume()]* -> stop() -> metrics under `rollout/{label}/`.

    Counters and time accumulate only while the window is open and not paused. One window at a
    time: starting a window while another is open is an error, so train and eval never mix.

    `snapshot_later`, where given, starts the snapshot a pause takes and returns what completes it; the
    window completes it at the next resume() or stop(). Its caller guarantees that the snapshot holds the
    counters as they were at the pause (EngineClient waits for it before it generates again).
    """

    def __init__(self, snapshot: Callable[[], SpecCounters], num_speculative_tokens: int,
                 clock: Callable[[], float] = time.monotonic,
                 snapshot_later: Callable[[], Callable[[], SpecCounters]] | None = None):
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) \
                or num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r} is invalid: an int >= 0")
        self._snapshot = snapshot
        self._k = num_speculative_tokens
        self._clock = clock
        self._label: str | None = None
        self._paused = False
        self._acc = SpecCounters()
        self._seconds = 0.0
        self._seg_counters: SpecCounters | None = None
        self._seg_start = 0.0
        self._snapshot_later = snapshot_later
        self._pending: tuple[Callable[[], SpecCounters], SpecCounters] | None = None   # a pause's snapshot

    @property
    def label(self) -> str | None:
        """The open window's label, or None."""
        return self._label

    @property
    def is_paused(self) -> bool:
        return self._paused

    def start(self, label: str) -> None:
        if not isinstance(label, str) or not label or "/" in label:
            raise ValueError(f"label={label!r} is invalid: a non-empty string without '/' (e.g. 'train', 'eval')")
        if self._label is not None:
            raise RuntimeError(f"cannot start metrics window {label!r}: window {self._label!r} is still open; "
                               "stop() it first (train and eval windows never mix)")
        self._label, self._paused = label, False
        self._acc, self._seconds = SpecCounters(), 0.0
        self._open_segment()

    def pause(self) -> None:
        self._require_open("pause")
        if self._paused:
            raise RuntimeError(f"metrics window {self._label!r} is already paused")
        self._close_segment(later=self._snapshot_later is not None)
        self._paused = True

    def resume(self) -> None:
        self._require_open("resume")
        if not self._paused:
            raise RuntimeError(f"metrics window {self._label!r} is not paused")
        self._complete_pause()
        self._paused = False
        self._open_segment()

    def stop(self) -> dict[str, float]:
        self._require_open("stop")
        try:
            if self._paused:
                self._complete_pause()
            else:
                self._close_segment()
        finally:
            label, delta, seconds = self._label, self._acc, self._seconds
            self._label, self._paused, self._pending = None, False, None
        return summarize_window(delta, label, self._k, seconds)

    def _require_open(self, action: str) -> None:
        if self._label is None:
            raise RuntimeError(f"cannot {action}() the metrics window: no window is open; call start(label) first")

    def _open_segment(self) -> None:
        self._seg_counters = self._snapshot()
        self._seg_start = self._clock()

    def _close_segment(self, later: bool = False) -> None:
        now = self._clock()
        if later:
            self._pending = (self._snapshot_later(), self._seg_counters)
        else:
            self._acc = self._acc + (self._snapshot() - self._seg_counters)
        self._seconds += now - self._seg_start
        self._seg_counters = None

    def _complete_pause(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            complete, opened = pending
            self._acc = self._acc + (complete() - opened)
