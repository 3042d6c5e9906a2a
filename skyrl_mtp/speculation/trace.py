"""A record of what an engine core told its speculation policy, and an exact replay of it.

Why this exists: under auto k the policy (adaptive_speculation.SpeculationPolicy) is fed only by the calls
the engine core's scheduler makes: the batch and kind of each step it asks k for, the timings of steady
steps, the drafts verified, the weight syncs. Replaying those calls through a fresh policy therefore gives
the k the engine ran at every step, and a change to the policy that is meant to leave its choices alone
(work on its speed, a refactor) can be checked on the engine's own traffic rather than on synthetic
rollouts only. The same replay times the policy's calls in a quiet process
(benchmarks/speculation_policy_trace.py).

Written when trainer.mtp.policy_trace_dir is set (EngineConfig.policy_trace_dir reaches the engine core as
POLICY_TRACE_ENV): one text file per engine core process, a line per call, flushed at every weight sync (an
engine stopped with its process may leave the calls after the last sync cut short: a replay reads what is there).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from skyrl_mtp.speculation.policy import SpeculationPolicy

POLICY_TRACE_ENV = "SKYRL_MTP_POLICY_TRACE_DIR"
FORMAT = "skyrl-mtp-policy-trace 1"


def _ints(values: list[int]) -> str:
    return ",".join(map(str, values)) or "-"


class PolicyTraceWriter:
    """Appends one line per call the scheduler makes to `policy` (the policy must be fresh: a replay
    starts from a new one with the same settings)."""

    def __init__(self, path: Path, policy: SpeculationPolicy):
        if policy.steps:
            raise ValueError(f"a policy trace starts with a fresh policy; this one has chosen {policy.steps} steps")
        self.path = Path(path)
        self._file: IO[str] = open(self.path, "w", encoding="ascii")
        self._file.write(f"{FORMAT}\nP {policy.k_max} {policy.max_batch} {policy.explore_budget!r}\n")

    def choose(self, batch: int, steady: bool, k: int, staying: int | None = None) -> None:
        """`staying`: what the policy was told when it asked how many requests stay (None: it did not ask)."""
        self._file.write(f"C {batch} {int(steady)} {k} {'-' if staying is None else staying}\n")

    def timed(self, num_tokens: int, batch: int, k: int, seconds: float) -> None:
        self._file.write(f"O {num_tokens} {batch} {k} {seconds!r}\n")

    def settled(self, position: int, num_tokens: int, batch: int, seconds: float) -> None:
        self._file.write(f"S {position} {num_tokens} {batch} {seconds!r}\n")

    def verified(self, batch: int, drafts: list[int], accepted: list[int]) -> None:
        self._file.write(f"V {batch} {_ints(drafts)} {_ints(accepted)}\n")

    def new_weights(self) -> None:
        self._file.write("W\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def writer_from_env(environ: Any, policy: SpeculationPolicy) -> PolicyTraceWriter | None:
    """The engine core's trace (policy_trace.<pid>.txt under POLICY_TRACE_ENV's directory), or None."""
    directory = environ.get(POLICY_TRACE_ENV)
    if not directory:
        return None
    Path(directory).mkdir(parents=True, exist_ok=True)
    return PolicyTraceWriter(Path(directory) / f"policy_trace.{os.getpid()}.txt", policy)


class PolicyTraceError(ValueError):
    """A trace file that is not one PolicyTraceWriter wrote."""


@dataclass(frozen=True)
class PolicyTrace:
    k_max: int
    max_batch: int | None
    explore_budget: float
    calls: list[tuple]   # ("C", batch, steady, k, staying) | ("O", tokens, batch, k, s) | ("S", pos, tokens, batch, s)
    #                      | ("V", batch, drafts, accepted) | ("W",)

    @property
    def steps(self) -> int:
        return sum(1 for c in self.calls if c[0] == "C")


def _list(text: str) -> list[int]:
    return [] if text == "-" else [int(v) for v in text.split(",")]


_PARSERS = {
    "C": (4, lambda f: ("C", int(f[1]), f[2] == "1", int(f[3]), None if f[4] == "-" else int(f[4]))),
    "O": (4, lambda f: ("O", int(f[1]), int(f[2]), int(f[3]), float(f[4]))),
    "S": (4, lambda f: ("S", int(f[1]), int(f[2]), int(f[3]), float(f[4]))),
    "V": (3, lambda f: ("V", int(f[1]), _list(f[2]), _list(f[3]))),
    "W": (0, lambda f: ("W",)),
}


def read_trace(path: Path) -> PolicyTrace:
    """The calls of one trace file. A last line cut short (an engine stopped mid-write) is dropped."""
    lines = Path(path).read_text(encoding="ascii").split("\n")
    if lines[0] != FORMAT:
        raise PolicyTraceError(f"{path}: first line {lines[0][:60]!r}, expected {FORMAT!r}")
    head = lines[1].split() if len(lines) > 1 else []
    if len(head) != 4 or head[0] != "P":
        raise PolicyTraceError(f"{path}:2: expected 'P k_max max_batch explore_budget', got {lines[1][:60]!r}")
    calls = []
    body = lines[2:]
    if body and body[-1]:   # no newline after it: cut short
        body = body[:-1]
    for number, line in enumerate(body, start=3):
        if not line:
            continue
        fields = line.split()
        parser = _PARSERS.get(fields[0])
        if parser is None or len(fields) != parser[0] + 1:
            raise PolicyTraceError(f"{path}:{number}: not a policy call: {line[:80]!r}")
        try:
            calls.append(parser[1](fields))
        except ValueError as e:
            raise PolicyTraceError(f"{path}:{number}: {e}: {line[:80]!r}") from e
    return PolicyTrace(int(head[1]), None if head[2] == "None" else int(head[2]), float(head[3]), calls)


@dataclass
class Replay:
    policy: SpeculationPolicy
    ks: list[int] = field(default_factory=list)          # what the replayed policy chose, per step
    recorded: list[int] = field(default_factory=list)    # what the engine ran, per step
    unrecorded_ask: int | None = None   # the first step where the replay asked how many requests stay and the
    #                                     engine's policy had not (its answer is not in the trace)
    choose_seconds: float = 0.0   # in SpeculationPolicy.choose
    feed_seconds: float = 0.0     # in the calls that feed it (timings, settling, verified drafts, weight syncs)

    @property
    def first_mismatch(self) -> int | None:
        """The first step (0-based) at which the replay chose another k than the engine or asked what the engine
        was not asked, or None."""
        k = next((i for i, (a, b) in enumerate(zip(self.ks, self.recorded)) if a != b), None)
        return min((i for i in (k, self.unrecorded_ask) if i is not None), default=None)


def _answer(staying: int | None, out: Replay, step: int):
    """The engine's answer to the policy's question at this step, for the replayed policy to ask."""
    def ask() -> int:
        if staying is None:   # the engine's policy did not ask here: the replay has departed from it
            if out.unrecorded_ask is None:
                out.unrecorded_ask = step
            return 1 << 30
        return staying
    return ask


def replay(trace: PolicyTrace) -> Replay:
    """Feed a fresh policy the trace's calls in order, as the engine core's scheduler did, timing them."""
    policy = SpeculationPolicy(k_max=trace.k_max, max_batch=trace.max_batch, explore_budget=trace.explore_budget)
    out = Replay(policy)
    clock = time.perf_counter
    choose, cost, ks, recorded = policy.choose, policy.cost, out.ks, out.recorded
    choose_s = feed_s = 0.0
    for call in trace.calls:
        kind = call[0]
        if kind == "C":
            ask = _answer(call[4], out, len(ks))   # (made before the clock starts: the engine makes none)
            t = clock()
            k = choose(call[1], call[2], ask)
            choose_s += clock() - t
            ks.append(k)
            recorded.append(call[3])
            continue
        t = clock()
        if kind == "O":
            cost.observe(call[1], call[2], call[3], call[4])
        elif kind == "S":
            policy.observe_settle(call[1], call[2], call[3], call[4])
        elif kind == "V":
            policy.observe_verified(call[1], call[2], call[3])
        else:
            policy.on_new_weights()
        feed_s += clock() - t
    out.choose_seconds, out.feed_seconds = choose_s, feed_s
    return out
