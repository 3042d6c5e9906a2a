"""A record of what an engine core told its speculation policy, and an exact replay of it.

Why this exists: under auto k the policy (policy.py) sees only the calls the engine core's scheduler makes
(the batch and kind of each step it asks k for, each step's time, the drafts verified, the weight syncs),
and it is deterministic. So replaying a trace through a fresh policy gives the k the engine ran at every
step: the engine's own traffic, to check a change to the policy against, or to see why it chose what it did
(benchmarks/speculation_policy_trace.py). Written when trainer.mtp.policy_trace_dir is set: one text file
per engine core process, a line per call, flushed at every weight sync.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from skyrl_mtp.speculation.policy import SpeculationPolicy

FORMAT = "skyrl-mtp-policy-trace 2"


class PolicyTraceError(ValueError):
    """A trace file that is not one PolicyTraceWriter wrote."""


class PolicyTraceWriter:
    """Appends one line per call the scheduler makes to a fresh policy."""

    def __init__(self, directory: str, policy: SpeculationPolicy):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"policy_trace.{os.getpid()}.txt"
        self._file = open(self.path, "w", encoding="ascii")
        self._file.write(f"{FORMAT}\nP {policy.k_max} {policy.explore_budget!r}\n")

    def choose(self, batch: int, steady: bool, k: int) -> None:
        self._file.write(f"C {batch} {int(steady)} {k}\n")

    def step_seconds(self, seconds: float) -> None:
        self._file.write(f"T {seconds!r}\n")

    def verified(self, batch: int, drafts: list[int], accepted: list[int]) -> None:
        self._file.write(f"V {batch} {','.join(map(str, drafts))} {','.join(map(str, accepted))}\n")

    def new_weights(self) -> None:
        self._file.write("W\n")
        self._file.flush()


@dataclass
class Replay:
    policy: SpeculationPolicy
    ks: list[int] = field(default_factory=list)         # what the replayed policy chose, per step
    recorded: list[int] = field(default_factory=list)   # what the engine ran, per step

    @property
    def first_mismatch(self) -> int | None:
        """The first step (0-based) at which the replay chose another k than the engine, or None."""
        return next((i for i, (a, b) in enumerate(zip(self.ks, self.recorded)) if a != b), None)


def replay(path: Path) -> Replay:
    """Feed a fresh policy a trace file's calls in order, as the engine core's scheduler did. A last line cut
    short (an engine stopped mid-write) is dropped."""
    lines = Path(path).read_text(encoding="ascii").split("\n")
    head = lines[1].split() if len(lines) > 1 else []
    if lines[0] != FORMAT or len(head) != 3 or head[0] != "P":
        raise PolicyTraceError(f"{path}: not a policy trace ({FORMAT!r}, then 'P k_max explore_budget')")
    out = Replay(SpeculationPolicy(int(head[1]), float(head[2])))
    policy = out.policy
    for number, line in enumerate(lines[2:-1], start=3):   # the last item follows the last newline
        f = line.split()
        try:
            if f[0] == "C" and len(f) == 4:
                out.ks.append(policy.choose(int(f[1]), f[2] == "1"))
                out.recorded.append(int(f[3]))
            elif f[0] == "T" and len(f) == 2:
                policy.step_seconds(float(f[1]))
            elif f[0] == "V" and len(f) == 4:
                policy.observe_verified(int(f[1]), [int(v) for v in f[2].split(",")], [int(v) for v in f[3].split(",")])
            elif f == ["W"]:
                policy.on_new_weights()
            else:
                raise ValueError("not a policy call")
        except (ValueError, IndexError) as e:
            raise PolicyTraceError(f"{path}:{number}: {e}: {line[:80]!r}") from e
    return out
