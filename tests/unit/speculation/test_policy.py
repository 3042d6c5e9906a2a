"""Auto k's policy on modelled engines: what it chooses against the best k, what exploring costs, how it
follows the head. The engines' step times are made up here (a fixed part, per token verified, per draft
step, with noise); the best k of each step is known from them, so every test checks what the policy
achieves, not how it gets there."""

from __future__ import annotations

import math
import random

import pytest

from skyrl_mtp.speculation.policy import (
    PROBE_GAP,
    REFRESH_ATTEMPTS,
    Acceptance,
    BucketCosts,
    SpeculationPolicy,
    bucket,
    bucket_label,
    expected_tokens,
)


def cpu_step(batch: int, k: int) -> float:
    """Shaped like the hidden-512 model on CPU (reading the weights bounds a small batch's forward): drafting
    pays at a few requests, hardly at 16, not at 64."""
    return 0.001 + max(0.008, 0.0004 * batch * (1 + k)) + (0.002 + 0.001 * k + 0.00005 * batch * k if k else 0.0)


def best_k(cost, batch: int, alpha: float, k_max: int) -> int:
    return max(range(k_max + 1), key=lambda k: expected_tokens([alpha] * k_max, k) / cost(batch, k))


class Engine:
    """Drives a policy as the engine core's scheduler does: choose, the step's time, the drafts verified by the
    next step, a weight sync between rollouts. Records (batch, k, best k, modelled seconds, tokens emitted)."""

    def __init__(self, policy: SpeculationPolicy, cost=cpu_step, seed: int = 0, noise: float = 0.05):
        self.policy, self.cost, self.rng, self.noise = policy, cost, random.Random(seed), noise
        self.steps: list[tuple[int, int, int, float, float]] = []
        self._pending = 0   # drafts per request of the step before, verified by the next

    def step(self, batch: int, alpha: float, steady: bool = True) -> int:
        p = self.policy
        if self._pending:
            drafts = [self._pending] * batch
            accepted = [next((i for i in range(d) if self.rng.random() > alpha), d) for d in drafts]
            p.observe_verified(batch, drafts, accepted)
        k = p.choose(batch, steady)
        seconds = self.cost(batch, k)
        p.step_seconds(seconds * math.exp(self.rng.gauss(0.0, self.noise)))
        self.steps.append((batch, k, best_k(self.cost, batch, alpha, p.k_max), seconds,
                           expected_tokens([alpha] * p.k_max, k)))
        self._pending = k
        return k

    def rollout(self, batches: list[int], alpha: float, prompt_steps: int = 2) -> None:
        self.policy.on_new_weights()
        self._pending = 0
        for i, batch in enumerate(batches):
            self.step(batch, alpha, steady=i >= prompt_steps)


def drain(rng: random.Random, requests: int = 64, lo: int = 20, hi: int = 100) -> list[int]:
    """A rollout's running batch per step: every request from the start, each ending at its own length."""
    lengths = sorted(rng.randint(lo, hi) for _ in range(requests))
    return [sum(1 for n in lengths if n > t) for t in range(lengths[-1])]


def tail_heavy(rng: random.Random) -> list[int]:
    """Most of 64 responses short, a few 8-16x longer: the batch spends most steps at a few requests."""
    lengths = sorted(rng.choice([24] * 7 + [rng.randint(200, 380)]) for _ in range(64))
    return [sum(1 for n in lengths if n > t) for t in range(lengths[-1])]


def seconds_at(eng: Engine, since: int, alpha: float, k: int | None = None) -> float:
    """Modelled engine time of the tokens the policy emitted over the steps since `since`: as it ran them, or
    as an engine at a fixed k would (each step's batch emitting the same tokens in E(k_run) / E(k) as many
    steps at k)."""
    e = [expected_tokens([alpha] * eng.policy.k_max, j) for j in range(eng.policy.k_max + 1)]
    return sum(eng.cost(b, ran) if k is None else eng.cost(b, k) * e[ran] / e[k] for b, ran, *_ in eng.steps[since:])


def speedup(eng: Engine, since: int, alpha: float, over: int | None = 0) -> float:
    """How much faster the policy ran those steps' tokens than a fixed k (`over`; None: the best k of each step)."""
    if over is None:
        e = [expected_tokens([alpha] * eng.policy.k_max, j) for j in range(eng.policy.k_max + 1)]
        best = sum(eng.cost(b, kb) * e[ran] / e[kb] for b, ran, kb, *_ in eng.steps[since:])
        return best / seconds_at(eng, since, alpha)
    return seconds_at(eng, since, alpha, over) / seconds_at(eng, since, alpha)


# --------------------------------------------------------------------------------------------- pure parts

def test_buckets_split_at_powers_of_two_and_keep_the_rollout_tail_apart():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 65)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 6, 7]
    assert [bucket_label(b) for b in range(8)] == ["1", "2", "3-4", "5-8", "9-16", "17-32", "33-64", "65-128"]


def test_expected_tokens_is_one_plus_the_prefix_products():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0


def test_acceptance_is_conditional_per_position_and_refreshed_at_a_weight_sync():
    acc = Acceptance(k_max=3, decay=1.0)
    # four requests with 3 drafts: accepted 0, 1, 3, 3 -> position 1 tried 4 kept 3; 2 tried 3 kept 2; 3 tried 2 kept 2
    acc.observe([3, 3, 3, 3], [0, 1, 3, 3])
    assert acc.attempts == [4, 3, 2] and acc.accepts == [3, 2, 2]
    assert acc.rates() == pytest.approx([3.5 / 5, 2.5 / 4, 2.5 / 3])
    for _ in range(20):
        acc.observe([3] * 10, [3] * 10)
    measured = [a / t for a, t in zip(acc.accepts, acc.attempts)]
    acc.refresh()
    assert max(acc.attempts) == REFRESH_ATTEMPTS
    assert [a / t for a, t in zip(acc.accepts, acc.attempts)] == pytest.approx(measured)
    rates = acc.rates()
    acc.observe([1] * 8, [0] * 8)   # a new head, rejected: now weighs a third of the evidence at position 1
    assert acc.rates()[0] < 0.7 * rates[0] and acc.rates()[1:] == pytest.approx(rates[1:])


def test_a_buckets_costs_compare_ks_timed_at_different_batches():
    costs = BucketCosts(k_max=2)
    for step, batch in enumerate((33, 40, 48, 56, 64)):   # k = 0 across the bucket: a line
        costs.observe(batch, 0, cpu_step(batch, 0), step)
    assert costs.plain_seconds(36) == pytest.approx(cpu_step(36, 0))
    costs.observe(60, 2, cpu_step(60, 2), 9)            # k = 2 timed near the top only
    assert not costs.timed(1) and costs.timed(2)
    assert costs.ratio(2) * costs.plain_seconds(60) == pytest.approx(cpu_step(60, 2))
    assert costs.ratio(2) == pytest.approx(cpu_step(60, 2) / cpu_step(60, 0))


# --------------------------------------------------------------------------------- what the policy achieves

@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("batch", [1, 4, 16, 64])
def test_at_a_steady_batch_it_settles_on_the_best_k(alpha, batch):
    eng = Engine(SpeculationPolicy(k_max=3), seed=batch)
    for _ in range(300):
        eng.step(batch, alpha)
    since, best = 100, eng.steps[-1][2]
    # within 4% of the best k's speed, exploring included (its budget: 2% of the time) ...
    assert speedup(eng, since, alpha, over=best) >= 0.96
    ran = [k for _, k, *_ in eng.steps[since:]]
    if sorted(speedup(eng, since, alpha, over=k) for k in range(4))[1] > 1.1:   # ... and at the best k itself
        assert ran.count(best) >= 0.85 * len(ran), (best, ran[-40:])          # where it beats the others by 10%


@pytest.mark.parametrize("seed", range(3))
def test_on_a_tail_heavy_rollout_it_drafts_in_the_tail_and_not_at_the_full_batch(seed):
    rng, eng = random.Random(seed), Engine(SpeculationPolicy(k_max=3), seed=seed)
    for _ in range(3):   # an engine times its buckets once; RL runs hundreds of rollouts
        eng.rollout(tail_heavy(rng), alpha=0.9)
    since = len(eng.steps)
    for _ in range(5):
        eng.rollout(tail_heavy(rng), alpha=0.9)
    rows = eng.steps[since:]
    assert sum(k for b, k, *_ in rows if b <= 4) / sum(1 for b, *_ in rows if b <= 4) > 2.5
    assert sum(k for b, k, *_ in rows if b >= 33) / sum(1 for b, *_ in rows if b >= 33) < 0.2
    fixed = [speedup(eng, since, 0.9, over=k) for k in range(4)]
    assert min(fixed[1:]) >= 0.97 and fixed[0] >= 1.2 and speedup(eng, since, 0.9, over=None) >= 0.95, fixed


@pytest.mark.parametrize("seed", range(3))
def test_with_an_untrained_head_it_stays_within_its_budget_of_no_spec(seed):
    rng, eng = random.Random(seed), Engine(SpeculationPolicy(k_max=3, explore_budget=0.02), seed=seed)
    for _ in range(2):
        eng.rollout(drain(rng), alpha=0.0)
    since = len(eng.steps)
    for _ in range(10):
        eng.rollout(drain(rng), alpha=0.0)
    assert speedup(eng, since, 0.0) >= 0.97


@pytest.mark.parametrize("budget", [0.0, 0.01, 0.05])
def test_exploring_costs_no_more_than_its_budget_beyond_the_best_k(budget):
    rng, eng = random.Random(1), Engine(SpeculationPolicy(k_max=3, explore_budget=budget), seed=1)
    eng.rollout(drain(rng), alpha=0.6)
    eng.rollout(drain(rng), alpha=0.6)
    since = len(eng.steps)
    for _ in range(10):
        eng.rollout(drain(rng), alpha=0.6)
    assert speedup(eng, since, 0.6, over=None) >= 1.0 - budget - 0.01   # against the best k of every step


@pytest.mark.parametrize("seed", range(3))
def test_a_head_that_starts_paying_is_followed_within_a_few_rollouts_and_one_that_stops_within_one(seed):
    rng, eng = random.Random(seed), Engine(SpeculationPolicy(k_max=3), seed=seed)
    for _ in range(5):
        start = len(eng.steps)
        eng.rollout(drain(rng), alpha=0.0)
    assert sum(k == 0 for _, k, *_ in eng.steps[start:]) >= 0.9 * (len(eng.steps) - start)
    followed = None
    for r in range(6):
        start = len(eng.steps)
        eng.rollout(drain(rng), alpha=0.95)
        ran = eng.steps[start:]
        if sum(k == best for _, k, best, *_ in ran) >= 0.5 * len(ran):
            followed = r
            break
    assert followed is not None and followed <= 3, followed
    start = len(eng.steps)
    eng.rollout(drain(rng), alpha=0.0)   # the head stops being accepted
    ran = eng.steps[start:]
    assert sum(k == 0 for _, k, *_ in ran[len(ran) // 4:]) >= 0.9 * len(ran[len(ran) // 4:])


def test_a_new_bucket_runs_no_drafts_until_timed_and_explorations_stay_on_steady_steps_in_their_bucket():
    p = SpeculationPolicy(k_max=2)
    assert p.choose(64, steady=False) == 0 and p.choose(64, steady=False) == 0   # prompt steps: nothing explored
    assert [p.choose(64) for _ in range(2)] == [0, 0]   # the bucket's first steady steps time k = 0 first ...
    p.step_seconds(0.010)
    assert p.choose(64) == 1       # ... then k = 1 (two steps, the second timed)
    assert p.choose(30) == 0       # the batch left the bucket: that exploration stops, this bucket starts its own
    assert p.choose(60) == 1       # back in the bucket: its timing resumes
    assert p.explored_steps >= 2 and p.stats()["bucket_cost_ratio"]["33-64"][1] is None


def test_explorations_keep_their_gap_and_budget():
    p = SpeculationPolicy(k_max=1, explore_budget=0.5)
    eng = Engine(p, seed=3)
    for _ in range(400):
        eng.step(8, 0.5)
    ks = [k for _, k, *_ in eng.steps[10:]]
    starts = [i for i in range(1, len(ks)) if ks[i] != ks[i - 1] and ks[i] != eng.steps[-1][2]]
    assert starts and min(b - a for a, b in zip(starts, starts[1:])) >= PROBE_GAP


def test_verified_drafts_are_credited_the_engine_time_they_saved():
    p = SpeculationPolicy(k_max=2)
    eng = Engine(p, cost=lambda b, k: 0.010 + 0.004 * k, noise=0.0)
    for _ in range(12):
        eng.step(8, 1.0)
    saved = p.seconds_saved
    p.observe_verified(8, [2] * 8, [2] * 8)   # two plain steps' tokens (20 ms) for 8 ms of drafting
    assert p.seconds_saved - saved == pytest.approx(0.012)
    p.observe_verified(8, [2] * 4, [0] * 4)   # nothing accepted: the drafting was a loss
    assert p.seconds_saved - saved == pytest.approx(0.012 - 0.008)
    p.observe_verified(8, [0] * 8, [0] * 8)
    assert p.seconds_saved - saved == pytest.approx(0.004) and p.stats()["seconds_saved"] == p.seconds_saved


def test_stats_count_the_chosen_k_apart_from_exploration():
    rng, eng = random.Random(0), Engine(SpeculationPolicy(k_max=3), seed=0)
    for _ in range(4):
        eng.rollout(drain(rng), alpha=0.8)
    s = eng.policy.stats()
    assert s["steps"] == len(eng.steps) == sum(s["k_histogram"]) == sum(s["model_k_histogram"])
    assert s["k_sum"] == sum(k for _, k, *_ in eng.steps)
    assert 0 < s["explored_steps"] < 0.3 * s["steps"]
    assert sum(map(sum, s["bucket_k_histogram"].values())) == s["steps"]
    assert all(len(r) == 4 and r[0] == 1.0 for r in s["bucket_cost_ratio"].values() if r[0] is not None)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="k_max=0"):
        SpeculationPolicy(k_max=0)
    with pytest.raises(ValueError, match="explore_budget=0.9 is invalid"):
        SpeculationPolicy(k_max=2, explore_budget=0.9)
