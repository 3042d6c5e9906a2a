"""The policy trace: written as the engine core's scheduler feeds its policy, replayed to the same k at every
step; a trace cut short replays up to its cut, and a garbled one is refused naming the line."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from skyrl_mtp.speculation.policy import SpeculationPolicy
from skyrl_mtp.speculation.trace import PolicyTraceError, PolicyTraceWriter, replay


def _cost(batch: int, k: int) -> float:
    return 0.001 + max(0.008, 0.0004 * batch * (1 + k)) + (0.002 + 0.001 * k if k else 0.0)


def _engine(policy: SpeculationPolicy, trace: PolicyTraceWriter, seed: int, rollouts: int = 12) -> list[int]:
    """Drives `policy` as the scheduler does (prompt steps, a full batch, a draining tail; noisy timings; drafts
    verified by the next step, accepted at 0.8 per position; a weight sync between rollouts), writing every call
    to `trace`. Returns the k of each step."""
    rng = random.Random(seed)
    shape = [(1, False), (64, False)] + [(64, True)] * 25 + [(b, True) for b in (40, 33, 12, 4, 3, 3, 2)] + [(1, True)] * 20
    ks, pending = [], 0
    for _ in range(rollouts):
        for batch, steady in shape:
            if pending:
                drafts = [pending] * batch
                accepted = [next((i for i in range(pending) if rng.random() > 0.8), pending) for _ in drafts]
                policy.observe_verified(batch, drafts, accepted)
                trace.verified(batch, drafts, accepted)
            k = policy.choose(batch, steady)
            trace.choose(batch, steady, k)
            seconds = _cost(batch, k) * math.exp(rng.gauss(0.0, 0.1))
            policy.step_seconds(seconds)
            trace.step_seconds(seconds)
            ks.append(k)
            pending = k
        policy.on_new_weights()
        trace.new_weights()
        pending = 0
    return ks


def test_a_trace_replays_to_the_k_of_every_step_and_a_changed_one_shows_where(tmp_path):
    policy = SpeculationPolicy(k_max=3, explore_budget=0.05)
    trace = PolicyTraceWriter(str(tmp_path), policy)
    ks = _engine(policy, trace, seed=1)
    assert len(set(ks)) >= 3     # a trace worth replaying: the policy explored and drafted
    again = replay(trace.path)
    assert again.ks == ks and again.recorded == ks and again.first_mismatch is None
    assert again.policy.stats() == policy.stats() and again.policy.explore_budget == 0.05
    lines = trace.path.read_text().split("\n")
    first_t = next(i for i, line in enumerate(lines) if line.startswith("T "))
    changed = [("T 9.0" if i > first_t and line.startswith("T ") else line) for i, line in enumerate(lines)]
    (tmp_path / "slow.txt").write_text("\n".join(changed))    # every step timed slow: other choices follow
    assert replay(tmp_path / "slow.txt").first_mismatch is not None


def test_a_trace_cut_short_mid_line_replays_up_to_it_and_a_garbled_one_is_refused(tmp_path):
    policy = SpeculationPolicy(k_max=2)
    trace = PolicyTraceWriter(str(tmp_path / "t"), policy)
    _engine(policy, trace, seed=2, rollouts=3)
    text = Path(trace.path).read_text()
    (tmp_path / "cut.txt").write_text(text + "C 64 1")   # the engine stopped while writing a line
    assert replay(tmp_path / "cut.txt").ks == replay(trace.path).ks
    (tmp_path / "bad.txt").write_text(text.replace("\nW\n", "\nW x\n", 1))
    with pytest.raises(PolicyTraceError, match=r"bad.txt:\d+: not a policy call: 'W x'"):
        replay(tmp_path / "bad.txt")
    (tmp_path / "num.txt").write_text(text.replace("\nC 1 ", "\nC one ", 1))
    with pytest.raises(PolicyTraceError, match=r"num.txt:\d+: .*'C one"):
        replay(tmp_path / "num.txt")
    (tmp_path / "other.txt").write_text("something else\n")
    with pytest.raises(PolicyTraceError, match="not a policy trace"):
        replay(tmp_path / "other.txt")
