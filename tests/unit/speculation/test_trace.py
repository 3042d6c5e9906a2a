"""The policy trace: written as the engine core's scheduler feeds its policy, replayed to the same k at every
step; bad traces and misplaced settings are refused, naming what is wrong."""

from __future__ import annotations

import math
import random

import pytest

from skyrl_mtp.config import ConfigError
from skyrl_mtp.config.loader import load_config
from skyrl_mtp.rollout.config import EngineConfig
from skyrl_mtp.rollout.engine import engine_environment
from skyrl_mtp.speculation.policy import SpeculationPolicy
from skyrl_mtp.speculation.trace import (
    FORMAT,
    POLICY_TRACE_ENV,
    PolicyTraceError,
    PolicyTraceWriter,
    read_trace,
    replay,
    writer_from_env,
)
from skyrl_mtp.trainer.run_plan import engine_config


def _step_seconds(batch: int, k: int) -> float:
    return (2.4 + 0.085 * batch + (k > 0) * (2.5 + 0.12 * batch + (k - 1) * (0.8 + 0.02 * batch))) / 1000


def _engine(policy: SpeculationPolicy, trace: PolicyTraceWriter, seed: int, rollouts: int = 25) -> list[int]:
    """Drives `policy` as the adaptive scheduler does (rollouts with prompt steps, a full batch and a draining
    tail; timings of steady steps at an unchanged k, with noise; drafts verified at the next step, accepted
    at 0.7 per position; a weight sync between rollouts; settling steps timed apart; the requests that stay
    are those of the next step), writing every call to `trace`. Returns the k of each step."""
    rng = random.Random(seed)
    shape = [(1, False), (64, False)] + [(64, True)] * 25 + [(b, True) for b in (40, 33, 12, 4, 3, 3, 2, 1, 1)]
    ks, prev, pending = [], -1, None
    for _ in range(rollouts):
        for i, (batch, steady) in enumerate(shape):
            told = []

            def staying(i=i, told=told):
                told.append(shape[i + 1][0] if i + 1 < len(shape) else 0)
                return told[-1]

            if pending is not None:   # the previous step's drafts, verified by this one
                drafts = [pending] * batch
                accepted = [next((i for i in range(pending) if rng.random() > 0.7), pending) for _ in drafts]
                policy.acceptance.observe(drafts, accepted)
                policy.credit_verified(batch, drafts, accepted)
                trace.verified(batch, drafts, accepted)
            k = policy.choose(batch, steady, staying)
            trace.choose(batch, steady, k, told[0] if told else None)
            settle = policy.settling if steady else -1
            seconds = _step_seconds(batch, k) * math.exp(rng.gauss(0.0, 0.1))
            if policy.timing_valid and steady and settle >= 0:
                policy.observe_settle(settle, batch * (1 + k), batch, seconds * 1.2)
                trace.settled(settle, batch * (1 + k), batch, seconds * 1.2)
            elif policy.timing_valid and steady and k == prev:
                policy.cost.observe(batch * (1 + k), batch, k, seconds)
                trace.timed(batch * (1 + k), batch, k, seconds)
            ks.append(k)
            prev, pending = k, (k or None)
        policy.on_new_weights()
        trace.new_weights()
    return ks


def test_a_replayed_trace_chooses_the_engines_k_at_every_step(tmp_path):
    policy = SpeculationPolicy(k_max=3, max_batch=64, explore_budget=0.05)
    trace = PolicyTraceWriter(tmp_path / "t.txt", policy)
    ks = _engine(policy, trace, seed=0)
    trace.close()
    assert len(set(ks)) >= 3 and sum(k > 0 for k in ks) >= 40, ks   # it drafted at several depths and stopped
    got = read_trace(tmp_path / "t.txt")
    assert (got.k_max, got.max_batch, got.explore_budget, got.steps) == (3, 64, 0.05, len(ks))
    again = replay(got)
    assert again.recorded == ks and again.ks == ks and again.first_mismatch is None
    assert again.policy.stats() == policy.stats()      # the whole state, not only the choices
    assert again.choose_seconds > 0 and again.feed_seconds > 0


def test_a_replay_finds_where_a_trace_departs_from_the_policy(tmp_path):
    policy = SpeculationPolicy(k_max=3, max_batch=64)
    trace = PolicyTraceWriter(tmp_path / "t.txt", policy)
    ks = _engine(policy, trace, seed=1, rollouts=10)
    trace.close()
    lines = (tmp_path / "t.txt").read_text().split("\n")
    # the engine ran another k at one step than the policy chose (a scheduler that overrode it)
    steps = [i for i, line in enumerate(lines) if line.startswith("C ")]
    at = steps[200]
    fields = lines[at].split()
    lines[at] = " ".join(fields[:3] + [str((int(fields[3]) + 1) % 4)] + fields[4:])
    (tmp_path / "k.txt").write_text("\n".join(lines))
    assert replay(read_trace(tmp_path / "k.txt")).first_mismatch == 200
    # timings the policy never saw (another engine's): the choices part from the recorded ones
    slow = [(" ".join(ln.split()[:4] + [repr(3 * float(ln.split()[4]))]) if ln.startswith("O ") else ln) for ln in lines]
    (tmp_path / "slow.txt").write_text("\n".join(slow))
    assert replay(read_trace(tmp_path / "slow.txt")).first_mismatch is not None
    assert replay(read_trace(tmp_path / "t.txt")).ks == ks


def test_a_trace_cut_short_mid_line_replays_up_to_it_and_a_garbled_one_is_refused(tmp_path):
    policy = SpeculationPolicy(k_max=2)
    trace = PolicyTraceWriter(tmp_path / "t.txt", policy)
    _engine(policy, trace, seed=2, rollouts=3)
    trace.close()
    text = (tmp_path / "t.txt").read_text()
    (tmp_path / "cut.txt").write_text(text + "O 64 64")   # the engine stopped while writing a line
    assert read_trace(tmp_path / "cut.txt").calls == read_trace(tmp_path / "t.txt").calls
    (tmp_path / "bad.txt").write_text(text.replace("\nW\n", "\nW x\n", 1))
    with pytest.raises(PolicyTraceError, match=r"bad.txt:\d+: not a policy call: 'W x'"):
        read_trace(tmp_path / "bad.txt")
    (tmp_path / "num.txt").write_text(text.replace("\nC ", "\nC one ", 1).replace("C one 1 ", "C one ", 1))
    with pytest.raises(PolicyTraceError, match=r"num.txt:\d+: .*'C one"):
        read_trace(tmp_path / "num.txt")
    (tmp_path / "other.txt").write_text("something else\n")
    with pytest.raises(PolicyTraceError, match=f"expected '{FORMAT}'"):
        read_trace(tmp_path / "other.txt")
    used = SpeculationPolicy(k_max=2)
    used.choose(4)
    with pytest.raises(ValueError, match="starts with a fresh policy"):
        PolicyTraceWriter(tmp_path / "late.txt", used)


def test_policy_trace_dir_reaches_the_engine_core_and_only_with_auto_k(tmp_path):
    auto = ["recipe=tiny_dapo", "trainer.mtp.num_speculative_tokens=auto"]
    env = engine_environment(engine_config(load_config(auto + [f"trainer.mtp.policy_trace_dir={tmp_path}/tr"]), "/m"))
    assert env[POLICY_TRACE_ENV] == f"{tmp_path}/tr"
    writer = writer_from_env(env, SpeculationPolicy(k_max=3))   # what the scheduler does with it
    writer.close()
    assert writer.path.parent == tmp_path / "tr" and writer.path.name.startswith("policy_trace.")
    assert POLICY_TRACE_ENV not in engine_environment(engine_config(load_config(auto), "/m"))
    assert writer_from_env({}, SpeculationPolicy(k_max=3)) is None
    with pytest.raises(ConfigError, match="trainer.mtp.policy_trace_dir='/tmp/x' is invalid: applies only with"):
        load_config(["recipe=tiny_dapo", "trainer.mtp.policy_trace_dir=/tmp/x"])
    with pytest.raises(ConfigError, match="trainer.mtp.policy_trace_dir=' ' is invalid: must be a directory path"):
        load_config(auto + ["trainer.mtp.policy_trace_dir=' '"])
    with pytest.raises(ValueError, match="policy_trace_dir='/tmp/x'"):
        EngineConfig(model_path="/m", num_speculative_tokens=3, policy_trace_dir="/tmp/x")
