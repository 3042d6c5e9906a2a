"""Pure parts of adaptive speculation: acceptance estimate, online cost fit, the choice of k, the guard."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from skyrl_mtp.speculation.policy import (
    FOLD_EVERY,
    AcceptanceEstimate,
    AdaptiveSpeculationError,
    CostModel,
    LineRows,
    OnlineLinearFit,
    SpeculationPolicy,
    best_k,
    bucket,
    dynamic_schedule,
    expected_tokens,
    explore_budget_from_env,
    install,
    isotonic,
    plausible_rival,
    regret_seconds,
    settled_across,
    step_features,
    step_savings,
)


def test_expected_tokens_is_one_plus_sum_of_prefix_products():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0, 0.0, 1.0], 3) == pytest.approx(2.0)


def test_acceptance_is_conditional_per_position():
    est = AcceptanceEstimate(k_max=3, prior_weight=0.0)
    # 4 requests with 3 drafts: accepted 3, 1, 0, 2; one request with 1 draft, accepted 1
    est.observe([3, 3, 3, 3, 1], [3, 1, 0, 2, 1])
    # position 1 reached by all 5 (accepted by 4); position 2 reached by 3 of the k=3 requests with pos 1
    # accepted (accepted 2 of them); position 3 reached by 2 (accepted by 1)
    assert est.rates() == pytest.approx([4 / 5, 2 / 3, 1 / 2])


def test_acceptance_counts_equal_a_position_by_position_count():
    """observe counts positions reached and accepted from per-request histograms; the same as walking each
    request's drafts position by position, for mixed draft lengths and out-of-range inputs (clipped)."""
    rng = random.Random(7)
    for _ in range(50):
        k_max = rng.randint(1, 5)
        drafts = [rng.randint(0, k_max + 1) for _ in range(rng.randint(1, 40))]
        accepted = [rng.randint(-1, d + 1) for d in drafts]
        est = AcceptanceEstimate(k_max=k_max, decay=1.0, prior_weight=0.0)
        est.observe(drafts, accepted)
        att, acc = [0.0] * k_max, [0.0] * k_max
        for d, a in zip(drafts, accepted):
            d = min(d, k_max)
            a = max(0, min(a, d))
            for i in range(min(a + 1, d)):
                att[i] += 1.0
                acc[i] += float(i < a)
        if any(drafts):
            assert est.attempts == att and est.accepts == acc


def test_acceptance_follows_a_changing_head_and_keeps_unprobed_positions():
    est = AcceptanceEstimate(k_max=2, decay=0.5, prior_weight=0.0)
    est.observe([2] * 10, [0] * 10)
    est.observe([2] * 10, [1] * 10)         # position 2 reached 10 times, never accepted
    for _ in range(20):
        est.observe([1] * 10, [1] * 10)     # the head got good at position 1; position 2 not drafted meanwhile
    rates = est.rates()
    assert rates[0] > 0.99
    assert rates[1] == pytest.approx(0.0)   # kept (not decayed towards the prior) until probed again


def test_new_weights_keep_the_rates_but_let_the_new_heads_drafts_outweigh_the_old_ones():
    pol = SpeculationPolicy(k_max=2)
    for _ in range(60):
        pol.acceptance.observe([2] * 8, [2] * 8)          # a head whose drafts are all accepted
    before = pol.acceptance.rates()
    assert min(pol.acceptance.attempts) > 100
    version = pol.acceptance.version
    pol.on_new_weights()
    assert pol.acceptance.rates() == pytest.approx(before, abs=0.03)   # the prior pulls a little harder
    assert max(pol.acceptance.attempts) == pytest.approx(pol.refresh_attempts)
    assert pol.acceptance.version > version               # the memoised choice is computed again
    version = pol.acceptance.version
    pol.on_new_weights()                                  # no drafts since: nothing to cut, the same estimate
    assert pol.acceptance.version == version
    kept = pol.acceptance.rates()[1]
    for _ in range(4):
        pol.acceptance.observe([2] * 8, [0] * 8)          # the new head's drafts: never accepted
    assert pol.acceptance.rates()[0] < 0.4                # without the cut: still ~0.9
    assert pol.acceptance.rates()[1] == kept              # not reached since: kept


def test_probes_take_turns_over_the_neighbours_and_k0():
    pol = SpeculationPolicy(k_max=3)
    assert [pol._next_probe(2, p) for p in range(1, 7)] == [1, 3, 0, 1, 3, 0]
    assert [pol._next_probe(3, p) for p in range(1, 5)] == [2, 0, 2, 0]
    assert [pol._next_probe(1, p) for p in range(1, 5)] == [0, 2, 0, 2]
    assert [pol._next_probe(0, p) for p in range(1, 3)] == [1, 1]


def _accepted(rng: random.Random, alphas: list[float], k: int, batch: int) -> list[int]:
    """Drafts accepted per request of a verify step with k drafts each (conditional rates `alphas`)."""
    accepted = []
    for _ in range(batch):
        a = 0
        while a < k and rng.random() < alphas[a]:
            a += 1
        accepted.append(a)
    return accepted


def _engine(pol: SpeculationPolicy, rng: random.Random, batch: int, alphas: list[float], steps: int,
            seconds, stall: float = 0.05) -> list[int]:
    """A stand-in engine for the pure policy: per step, the chosen k, drafts accepted per request drawn from
    `alphas`, and a step time from `seconds(k)` with 10% noise and `stall` of the steps 1.5-3x slower; the
    time is observed when the step is steady (same k as the one before), as the scheduler does."""
    ks = []
    for _ in range(steps):
        k = pol.choose(batch)
        if k:
            pol.acceptance.observe([k] * batch, _accepted(rng, alphas, k, batch))
        t = seconds(k) * math.exp(rng.gauss(0.0, 0.1)) * (rng.uniform(1.5, 3.0) if rng.random() < stall else 1.0)
        if ks and ks[-1] == k and pol.timing_valid:
            pol.cost.observe(batch * (1 + k), batch, k, t)
        ks.append(k)
    return ks


@pytest.mark.parametrize("seed", range(8))
def test_a_head_that_stops_being_accepted_stops_the_drafting_within_a_rollout(seed):
    """The engines ran a good head at k ~ 3 (k = 0 timed only in the warm-up), then a weight sync brings a
    head whose drafts are never accepted: within ~40 steps the engine stops drafting, though k = 0 was
    timed a few times only and some of those steps stalled."""
    def seconds(k):
        return 0.006 + 0.00002 * 8 * (1 + k) + (k > 0) * 0.00096 + max(k - 1, 0) * 0.00066
    rng = random.Random(seed)
    pol = SpeculationPolicy(k_max=3)
    _engine(pol, rng, 8, [0.9, 0.8, 0.8], 34, seconds)
    pol.on_new_weights()
    ks = _engine(pol, rng, 8, [0.03, 0.03, 0.03], 120, seconds)
    assert ks[40:].count(0) > 0.8 * len(ks[40:]), ks


def test_online_linear_fit_recovers_a_line_and_forgets():
    fit = OnlineLinearFit(2, decay=0.9)
    for n in range(1, 40):
        fit.add([1.0, float(n)], 0.003 + 0.0002 * n)
    w = fit.weights()
    assert w == pytest.approx([0.003, 0.0002], rel=2e-2)
    for n in range(1, 200):
        fit.add([1.0, float(n % 40 + 1)], 0.010 + 0.0002 * (n % 40 + 1))
    assert fit.weights()[0] == pytest.approx(0.010, rel=3e-2)


def test_queued_samples_fold_into_the_same_fit_as_samples_added_one_at_a_time():
    rng = random.Random(3)
    samples = [([1.0, float(rng.randint(1, 64)), float(rng.random() < 0.3)], rng.uniform(0.003, 0.02))
               for _ in range(3 * FOLD_EVERY + 7)]   # folds at FOLD_EVERY, then a remainder at solve time
    xtx, xty, decay = np.zeros((3, 3)), np.zeros(3), 0.99
    fit = OnlineLinearFit(3, decay=decay, resolve_share=0.0)   # solved again whenever read
    for i, (x, y) in enumerate(samples):
        fit.add(x, y)
        xtx = xtx * decay + np.outer(x, x)
        xty = xty * decay + np.asarray(x) * y
        if i in (10, FOLD_EVERY - 1, 2 * FOLD_EVERY + 5):   # reading the fit folds what is queued
            fit.solves()
    x[0] = 5.0   # the caller's list changing after add does not reach the fit
    ridge = np.diag(fit.ridge * np.diag(xtx))
    want = np.linalg.solve(xtx + ridge, xty)
    assert fit.weights() == pytest.approx(want.tolist(), rel=1e-9)
    assert np.allclose(fit._xtx, xtx, rtol=1e-12) and np.allclose(fit._xty, xty, rtol=1e-12)


def test_online_linear_fit_measures_its_noise_and_how_sure_a_difference_is():
    rng = random.Random(0)
    fit = OnlineLinearFit(3, decay=1.0)
    assert math.isinf(fit.residual_variance()) and math.isinf(fit.difference_sd([1, 1, 0], [1, 0, 0]))
    sds = []
    for n in range(1, 2001):
        x = [1.0, float(n % 7), float(n % 3 == 0)]
        fit.add(x, 0.01 + 0.001 * x[1] + 0.004 * x[2] + rng.gauss(0.0, 0.0005))
        if n in (20, 2000):
            sds.append(fit.difference_sd([1.0, 3.0, 1.0], [1.0, 3.0, 0.0]))
    assert math.sqrt(fit.residual_variance()) == pytest.approx(0.0005, rel=0.1)
    # the third feature is on in a third of the samples: var(w3) ~ sigma^2 (1/n1 + 1/n0) = sigma^2 * 4.5/n
    assert sds[1] == pytest.approx(0.0005 * math.sqrt(4.5 / 2000), rel=0.15)
    assert sds[0] > 5 * sds[1]                                        # thin evidence: a wide margin
    assert fit.difference_sd([1.0, 2.0, 0.0], [1.0, 2.0, 0.0]) == 0.0
    never = OnlineLinearFit(2)
    for n in range(10):
        never.add([1.0, 0.0], 0.01 + 0.001 * (n % 2))
    assert math.isinf(never.difference_sd([1.0, 1.0], [1.0, 0.0]))   # a direction no sample explored
    assert never.predict([1.0, 1.0]) == pytest.approx(0.0105, rel=1e-3)  # the rest of the fit still predicts


def test_the_line_table_equals_the_one_at_a_time_answers_at_every_batch():
    """LineTable gives predict / difference_sd of rows p + b q in closed form in b: the same numbers as
    asking the fit about each row at that b, including rows that coincide at one b only, and directions no
    sample explored (infinite), for a fit without variance yet, one with an unexplored feature, and a full one."""
    rng = random.Random(1)
    ps = [[1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 2.0, 1.0, 0.0], [1.0, 0.0, 1.0, 2.0], [0.0] * 4,
          [1.0, -3.0, 1.0, 0.0]]
    qs = [[0.0, 3.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0], [0.0, 5.0, 0.0, 0.0], [0.0, 5.0, 0.0, 1.0], [0.0] * 4,
          [0.0, 4.0, 0.0, 0.0]]                           # the last row meets the first at b = 3
    young, partial, full = OnlineLinearFit(4), OnlineLinearFit(4), OnlineLinearFit(4)
    young.add([1.0, 2.0, 1.0, 0.0], 0.02)                # fewer samples than parameters: no variance yet
    for n in range(60):
        x = [1.0, float(n % 7), float(n % 3 == 0), float(n % 5 == 0)]
        y = 0.01 + 0.001 * x[1] + 0.004 * x[2] + 0.002 * x[3] + rng.gauss(0.0, 0.0005)
        full.add(x, y)
        partial.add(x[:3] + [0.0], y)                    # the last feature never explored
    line_rows = LineRows(ps, qs)
    for fit in (young, partial, full):
        lines = fit.line_table(line_rows)
        for b in (1.0, 2.0, 3.0, 7.0, 64.0, 127.0):
            rows = [[pi + b * qi for pi, qi in zip(p, q)] for p, q in zip(ps, qs)]
            preds, sds = lines.at(b)
            assert preds == pytest.approx([fit.predict(r) for r in rows], rel=1e-12, abs=1e-15)
            for i, a in enumerate(rows):
                for j, c in enumerate(rows):
                    want = fit.difference_sd(a, c)
                    assert (math.isinf(sds[i][j]) and math.isinf(want)) or sds[i][j] == pytest.approx(want, rel=1e-9), \
                        (b, i, j, sds[i][j], want)
    assert full.line_table(line_rows).at(3.0)[1][0][5] == 0.0 < full.line_table(line_rows).at(2.0)[1][0][5]
    assert math.isinf(partial.line_table(line_rows).at(2.0)[1][3][2])
    assert not math.isinf(partial.line_table(line_rows).at(2.0)[1][0][2])


def test_the_cost_models_version_moves_with_every_timing_that_may_change_an_unread_prediction():
    """CostModel.version (what a fast-path record of a bucket not yet timed at every k checks) moves when a k is
    timed for the first time in its bucket and when a fit gives up its solve for a new one, and not for a sample
    that leaves every solve in place: a record kept across such a sample would otherwise answer from costs the
    full choice no longer reads."""
    cost = CostModel(k_max=2)
    seen = []
    for k in (0, 0, 1, 1, 2, 2):
        before = cost.version
        cost.observe(8 * (1 + k), 8, k, 0.004 + 0.002 * k)
        seen.append(cost.version - before)
    assert seen == [1, 0, 1, 0, 1, 0]
    moved = 0
    for i in range(200):
        cost.table(8), cost.table(64)      # the buckets' fits and the one over all batches, read: solved
        fits = [*cost.buckets.values(), cost.global_fit]
        solutions = [f._solved for f in fits]
        before = cost.version
        batch = 64 if i % 2 else 8         # the fit over all batches takes both, the bucket's every other one
        cost.observe(batch, batch, 0, 0.004 if batch == 8 else 0.009)
        dropped = any(f._solved is not sol for f, sol in zip(fits, solutions))
        assert (cost.version != before) == dropped, i
        moved += dropped
    assert 10 <= moved <= 100    # each fit is solved again every ~20 of its samples once it is steady


def test_the_cost_tables_equal_the_fits_own_answers_at_each_batch():
    """The cost model's per-batch table (built from the fit's LineTable) holds what the fit predicts for
    step_features at that batch: the features are affine in the batch size, which the closed form relies on.
    Read while the fits keep being timed and solved again (each fit keeps the tables of its latest solve),
    and at the end."""
    rng = random.Random(3)
    cost = CostModel(3)

    def check(batches):
        for batch in batches:
            fit = cost._fit(batch)
            xs = [step_features(batch * (1 + k), batch, k) for k in range(4)]
            for k in range(4):
                assert cost.step_seconds(batch, k) == pytest.approx(max(fit.predict(xs[k]), 1e-6), rel=1e-9)
                assert cost.step_sd(batch, k) == pytest.approx(fit.difference_sd(xs[k], [0.0] * 6), rel=1e-9)
                for j in range(4):
                    assert cost.difference_sd(batch, k, j) == pytest.approx(fit.difference_sd(xs[k], xs[j]),
                                                                            rel=1e-9)

    for i in range(400):
        batch, k = rng.randint(1, 127), rng.randint(0, 3)
        cost.observe(batch * (1 + k), batch, k, 0.002 + 0.0001 * batch * (1 + k) + 0.003 * (k > 0)
                     + 0.0005 * rng.random())
        if i % 7 == 0:
            check((batch, rng.randint(1, 127)))
    check((1, 2, 5, 16, 40, 64, 100, 127))


def test_one_slow_step_in_a_thin_fit_does_not_make_drafts_look_free():
    """The steady batch's bucket, timed at every k twice by a calibration cycle, one k = 0 step of which
    was slow (the machine was busy): the fit then predicts k = 0 dearer than drafting."""
    def seconds(k):
        return 0.0057 + 0.003 * (k > 0) + 0.002 * max(k - 1, 0) + 0.00002 * 64 * k
    cost = CostModel(k_max=3)
    for rep in range(2):
        for k in range(0, 4) if rep == 0 else range(3, -1, -1):   # the slow step: before the bucket has a fit
            cost.observe(64 * (1 + k), 64, k, 0.045 if (rep, k) == (0, 0) else seconds(k))
    weak = [0.04, 0.04, 0.04]
    best, rates = best_k(weak, cost, 64, 3)
    assert max(range(4), key=rates.__getitem__) > 0, rates   # on the fit alone a draft would look free
    assert best == 0, rates                                   # not on this evidence
    rng = random.Random(0)
    for _ in range(50):                                       # k = 0 keeps being timed: the fit recovers
        cost.observe(64, 64, 0, seconds(0) * rng.uniform(0.9, 1.1))
    assert cost.step_seconds(64, 0) < 1.15 * seconds(0)
    assert best_k(weak, cost, 64, 3)[0] == 0
    assert best_k([0.9, 0.9, 0.9], cost, 64, 3)[0] == 2      # a good head's gain is beyond the margin


def test_a_stall_after_the_bucket_has_a_fit_counts_as_a_bounded_slow_step():
    def seconds(k):
        return 0.006 + 0.002 * (k > 0) + 0.001 * max(k - 1, 0)
    cost = CostModel(k_max=3)
    for k in (3, 2, 1, 0, 3, 2, 1, 0):
        cost.observe(8 * (1 + k), 8, k, seconds(k))
    assert cost.covers(8)
    cost.observe(8, 8, 0, 0.5)                     # the machine stalled for half a second
    assert cost.step_seconds(8, 0) < 0.006 * (1 + (cost.stall_ratio - 1) / 2)   # clipped to 1.5x, one of 3
    too_high = cost.step_seconds(8, 0)
    cost.observe(8, 8, 0, 0.005)                   # the fast side is not clipped: a high estimate comes down
    assert cost.step_seconds(8, 0) < too_high - 0.0003


def test_a_k_timed_once_in_its_bucket_is_not_clipped_to_the_fits_guess_elsewhere_in_it():
    # timings from the tiny default's bucket 32..63 on 2 CPU cores: k = 0 timed at many sizes, then one
    # timing each at k = 1, 2, 3 (the calibration cycle that completes the bucket) at 36-40 sequences
    cost = CostModel(k_max=3)
    for _ in range(2):
        for b in range(32, 64, 3):
            cost.observe(b, b, 0, 0.006 + 0.0001 * b)
    cost.observe(76, 38, 1, 0.021)
    cost.observe(120, 40, 2, 0.026)
    cost.observe(144, 36, 3, 0.036)
    assert cost.covers(62)
    assert cost.step_seconds(62, 3) < cost.step_seconds(62, 0)   # the fit's guess at 62: drafting for free
    cost.observe(62 * 4, 62, 3, 0.036)                           # the engine times k = 3 at 62: 36 ms
    for b in range(32, 64, 8):
        cost.observe(b, b, 0, 0.006 + 0.0001 * b)
    # counted in full, not as 1.5x the guess (which left k = 3 at 16 ms and drafting at 3x the plain step)
    assert cost.step_seconds(62, 3) > 0.030, cost.step_seconds(62, 3)
    rates = best_k([0.74, 0.34, 0.05], cost, 62, 3)[1]
    assert rates[3] < rates[0], rates                             # k = 3 no longer looks like it pays


def test_isotonic_pools_violators_by_weight():
    assert isotonic([1.0, 2.0, 3.0], [1, 1, 1]) == [1.0, 2.0, 3.0]
    assert isotonic([3.0, 1.0, 2.0], [1, 1, 1]) == pytest.approx([2.0, 2.0, 2.0])
    assert isotonic([9.0, 1.0, 2.0], [1, 99, 100]) == pytest.approx([1.08, 1.08, 2.0])   # the sure one wins
    assert isotonic([1.0, 3.0, 2.0, 4.0], [1, 1, 3, 1]) == pytest.approx([1.0, 2.25, 2.25, 4.0])


def test_monotone_costs_trust_the_ks_the_fit_is_sure_of():
    """k = 0 timed twice, slowly (at the start of the warm-up), while the engine drafted at k = 1..3 for
    many steps: the deeper costs are not lifted to k = 0's, which would make every draft look free."""
    rng = random.Random(3)
    def seconds(k):
        return 0.006 + 0.002 * (k > 0) + 0.001 * max(k - 1, 0)
    cost = CostModel(k_max=3)
    cost.observe(8, 8, 0, 0.012)
    cost.observe(8, 8, 0, 0.011)
    for i in range(120):
        k = 1 + i % 3
        cost.observe(8 * (1 + k), 8, k, seconds(k) * rng.uniform(0.9, 1.1))
    raw = [cost.step_seconds(8, k) for k in range(4)]
    assert raw[0] > raw[3]
    mono = cost.monotone_step_seconds(8)
    assert mono == sorted(mono)
    assert mono[3] == pytest.approx(raw[3], rel=0.02)       # k = 3, timed often, keeps its own cost
    assert mono[0] < 0.5 * (raw[0] + raw[3])                # k = 0, timed twice, gives way
    assert best_k([0.03] * 3, cost, 8, 3, incumbent=3)[0] < 3   # a useless head stops drafting deep


def test_best_k_keeps_the_incumbent_until_the_evidence_is_beyond_one_standard_error():
    rng = random.Random(1)
    cost = CostModel(k_max=1)
    for i in range(12):                 # k = 1 costs 10% more per step than k = 0, timed with +-20% noise
        k = i % 2
        cost.observe(16 * (1 + k), 16, k, 0.010 * (1 + 0.1 * k) * rng.uniform(0.8, 1.2))
    assert cost.difference_sd(16, 1, 0) > 0.05 * cost.step_seconds(16, 0)
    alphas = [0.12]                     # on the fit's means, k = 1 gives about 3% more tokens per second
    _, rates = best_k(alphas, cost, 16, 1)
    assert rates[1] > rates[0], rates
    assert best_k(alphas, cost, 16, 1, incumbent=0)[0] == 0   # within the noise: no switch either way
    assert best_k(alphas, cost, 16, 1, incumbent=1)[0] == 1
    assert best_k([0.6], cost, 16, 1, incumbent=0)[0] == 1    # a clear gain switches
    assert best_k([0.0], cost, 16, 1, incumbent=1)[0] == 0    # and so does a clear loss


def test_a_steady_fit_is_solved_again_only_after_its_new_samples_carry_a_tenth_of_its_weight():
    fit, eager = OnlineLinearFit(2), OnlineLinearFit(2, resolve_share=0.0)
    for n in range(1, 11):                  # young fit (weight < 10): solved again after every sample
        fit.add([1.0, float(n % 5)], 0.004 + 0.001 * (n % 5))
        assert fit.solves() == n
    for n in range(2000):                   # weight ~200: about every 20 samples
        for f in (fit, eager):
            f.add([1.0, float(n % 5)], 0.004 + 0.001 * (n % 5))
            f.solves()
    before, lag = fit.solves(), 0.0
    for n in range(100):
        for f in (fit, eager):
            f.add([1.0, float(n % 5)], 0.008 + 0.001 * (n % 5))   # the step got slower
        lag = max(lag, eager.predict([1.0, 0.0]) - fit.predict([1.0, 0.0]))
    assert 4 <= fit.solves() - before <= 6
    assert eager.predict([1.0, 0.0]) > 0.0055 and 0 < lag < 0.0005   # it follows, at most ~20 samples behind


def test_the_policy_recomputes_its_choice_when_acceptance_or_the_fit_changes():
    pol = SpeculationPolicy(k_max=2, warmup_cycles=1, probe_every=0)
    [pol.choose(4) for _ in range(6)]
    pol.cost = _cost(0.010, 0.0008, 0.002, 0.0002, 0.002, 0.0002)
    pol.acceptance.observe([2] * 50, [0] * 50)
    assert [pol.choose(4) for _ in range(3)] == [0, 0, 0]
    pol.acceptance.observe([2] * 400, [2] * 400)        # the head got good: the next step sees it
    assert pol.choose(4) == 2
    pol.acceptance = AcceptanceEstimate(k_max=2)        # a fresh estimate (version 0 again) is not mistaken
    pol.acceptance.observe([2] * 50, [0] * 50)          # for the old one
    assert pol.choose(4) == 0


def _cost(t0, t1, d0, d1, e0, e1, batches=(1, 2, 4, 8, 16, 32, 64)) -> CostModel:
    """Whole-step timings: verify n tokens, then (k > 0) a first draft pass and k - 1 more draft steps."""
    cost = CostModel(k_max=3)
    for b in batches:
        for k_prev in range(4):
            for k in range(4):
                n = b * (1 + k_prev)
                cost.observe(n, b, k, t0 + t1 * n + (k > 0) * (d0 + d1 * b) + max(k - 1, 0) * (e0 + e1 * b))
    return cost


def test_best_k_deepens_at_small_batch_and_stops_at_large_batch():
    # per-step overhead dominates at batch 1; the verify cost grows with tokens at batch 64
    cost = _cost(t0=0.010, t1=0.0008, d0=0.002, d1=0.0002, e0=0.002, e1=0.0002)
    good = [0.9, 0.85, 0.8]
    k1, _ = best_k(good, cost, 1, 3)
    k64, rates = best_k(good, cost, 64, 3)
    assert k1 == 3
    assert k64 == 0, rates
    k_bad, _ = best_k([0.01, 0.01, 0.01], cost, 1, 3)
    assert k_bad == 0


def test_cost_model_uses_a_bucket_fit_once_it_has_seen_every_k():
    # the global fit only saw batch 1: its batch terms are unidentified, so it mispredicts batch 16
    cost = _cost(t0=0.010, t1=0.0001, d0=0.004, d1=0.0, e0=0.004, e1=0.0, batches=(1,))
    assert not cost.covers(16)
    extrapolated = cost.step_seconds(16, 3)
    for k_prev in range(4):
        for k in range(4):
            n = 16 * (1 + k_prev)
            cost.observe(n, 16, k, 0.010 + 0.0001 * n + (k > 0) * 0.02 + max(k - 1, 0) * 0.02)
    assert cost.covers(16) and cost.covers(20) and not cost.covers(32)   # bucket 16..31
    assert cost.step_seconds(16, 3) == pytest.approx(0.010 + 0.0001 * 64 + 0.06, rel=1e-3)
    assert abs(extrapolated - cost.step_seconds(16, 3)) > 0.2 * cost.step_seconds(16, 3)
    assert cost.step_seconds(1, 3) == pytest.approx(0.010 + 0.0001 * 4 + 0.012, rel=1e-3)   # bucket 1 untouched


def test_a_fit_that_calls_deeper_steps_cheaper_does_not_buy_useless_drafts():
    # noisy timings on a loaded machine: the fit's slopes in tokens and in draft steps came out negative
    cost = CostModel(k_max=3)
    for b in (8, 16, 32):
        for k_prev in range(4):
            for k in range(4):
                cost.observe(b * (1 + k_prev), b, k, 0.016 - 0.00001 * b * (1 + k_prev) - 0.003 * max(k - 1, 0))
    assert cost.step_seconds(16, 3) < cost.step_seconds(16, 0)   # the fit really is non-monotone
    k, rates = best_k([0.0, 0.5, 0.5], cost, 16, 3)
    assert k == 0, rates        # no accepted draft at position 1: every deeper k emits one token per step
    k_good, _ = best_k([0.95, 0.95, 0.95], cost, 16, 3)
    assert k_good == 3          # with a good head the same fit still deepens


def test_policy_calibrates_then_exploits_and_probes():
    # at one batch size throughout: no smaller batch for a probe to wait for (that is tested below)
    pol = SpeculationPolicy(k_max=2, warmup_cycles=1, probe_every=10, explore_budget=1.0, probe_cheaper_by=math.inf)
    first = [pol.choose(4) for _ in range(6)]
    assert first == [2, 2, 1, 1, 0, 0]     # each k twice: the second step at a k is steady (timed)
    assert not pol.timing_valid            # the first cycle pays one-off costs: not timed
    pol.cost = _cost(0.010, 0.0008, 0.002, 0.0002, 0.002, 0.0002)
    pol.acceptance.observe([2] * 50, [0] * 50)   # a useless head
    later = [pol.choose(4) for _ in range(64)]
    assert pol.timing_valid
    probed = [i for i, k in enumerate(later, start=7) if k]
    # probes back off while they change nothing: 10 steps after the first choice, then 20, then 40; each
    # holds its k two steps, so the second is steady (timed)
    assert probed == [17, 18, 37, 38], later
    assert all(later[i - 7] == 1 for i in probed)  # from k = 0 the probe is one draft step (the cheapest)
    st = pol.stats()
    assert st["steps"] == 70 and st["k_sum"] == sum(first) + sum(later)
    assert sum(st["k_histogram"]) == 70
    # the model chose k = 0 on every step after the warm-up cycle (whose 6 steps it had not chosen: not
    # counted); the cycle's 6 steps and the probes' 4 are exploration
    assert st["model_k_histogram"] == [64, 0, 0] and st["explored_steps"] == 10
    # a new batch bucket with a useless head: nothing to calibrate for, so no drafting cycle there
    assert [pol.choose(64) for _ in range(3)] == [0, 0, 0]
    assert pol.stats()["calibrated_buckets"] == [1, 2, 3, 4, 5, 6, 7]   # what the cost model was timed at
    # the head improves: the best k moves, and the probes watch closely again
    pol.acceptance = type(pol.acceptance)(k_max=2)
    pol.acceptance.observe([2] * 200, [2] * 200)
    assert pol.choose(4) == 2
    nxt = [pol.choose(4) for _ in range(30)]
    # the probe already due at step 77 runs (shallower from k = 2, held two steps so it is timed); the
    # interval restarted at 10 steps and, as that probe changed nothing, doubles to 20
    assert nxt[:4] == [2, 2, 1, 1] and [i for i, k in enumerate(nxt) if k != 2] == [2, 3, 22, 23], nxt
    # probes do not move the incumbent: after them the model's own choice stands
    assert pol._incumbent == {3: 2, 7: 0}


def test_a_new_batch_bucket_drafts_only_once_it_was_timed_there_at_every_k():
    """A bucket not yet timed at every k runs k = 0, whatever the fit over all batches says: that fit
    extrapolates (on the tiny default it priced k = 0 at 3 sequences at 1.3x its cost and a draft step at 63
    sequences at half its cost, and the tail drafted at a loss). Where drafting may pay, the bucket's
    calibration cycle starts at once, nearest k = 0 (its steps give up nothing against what the bucket runs),
    and once the engine has timed it the bucket drafts on its own fit."""
    def seconds(b: int, k: int) -> float:
        return 0.010 + 0.0008 * b * (1 + k) + (k > 0) * (0.002 + 0.0002 * b) + max(k - 1, 0) * (0.002 + 0.0002 * b)

    pol = SpeculationPolicy(k_max=2, warmup_cycles=1, probe_every=0)
    assert [pol.choose(1) for _ in range(6)] == [2, 2, 1, 1, 0, 0]
    for b in (1, 2, 3):
        for k in range(3):
            for _ in range(4):
                pol.cost.observe(b * (1 + k), b, k, seconds(b, k))
    pol.acceptance.observe([2] * 50, [2] * 50)   # a good head
    assert pol.choose(1) == 2
    assert best_k(pol.acceptance.rates(), pol.cost, 16, 2)[0] == 2   # what the fit over batches 1-3 says at 16
    assert [pol.choose(16) for _ in range(6)] == [0, 0, 1, 1, 2, 2]     # k = 0 and the bucket's cycle at once
    assert pol.stats()["calibrated_buckets"] == [1, 2]   # the cycle's steps were timed by the engine, not here
    assert not pol._queue and bucket(17) in pol._cycled  # same bucket: the cycle ran once, none is queued again
    for k in range(3):   # the engine timed the cycle's steps
        for b in (16, 20, 24):
            pol.cost.observe(b * (1 + k), b, k, seconds(b, k))
    assert pol.cost.covers(16)
    assert [pol.choose(17) for _ in range(2)] == [2, 2]                 # its own fit: drafting pays here
    assert [pol.choose(2) for _ in range(2)] == [2, 2]                  # a bucket timed at every k: no cycle


def _costly_drafts(batches=(1, 4, 16, 64)) -> CostModel:
    """A draft step costs ten plain steps (a tiny model: per-step overheads of the drafter dominate)."""
    cost = CostModel(k_max=2)
    for b in batches:
        for k in range(3):
            cost.observe(b * (1 + k), b, k, 0.010 + 0.09 * (k > 0) + 0.05 * max(k - 1, 0))
    return cost


def test_probes_wait_for_their_exploration_budget():
    pol = SpeculationPolicy(k_max=2, warmup_cycles=1, probe_every=10, explore_budget=0.02)
    [pol.choose(4) for _ in range(6)]
    pol.cost = _costly_drafts()
    pol.acceptance.observe([2] * 50, [1] * 50)   # the first draft accepted, the second not: still no k > 0 pays
    later = [pol.choose(4) for _ in range(1000)]
    probed = [i for i, k in enumerate(later, start=7) if k]
    # a probe (k = 1, two steps of 0.100 s) emits 1.99 tokens per step, which k = 0 gives in 0.0199 s:
    # 2 x 0.0801 s of regret, so 2% of the time allows one per 801 steps
    assert probed == [6 + 801, 6 + 802], probed      # from the 801st step chosen by the model


def test_a_probe_from_k0_waits_for_a_batch_where_it_costs_less_for_at_most_one_interval():
    # a step at k = 1 costs 0.2 ms + 0.15 ms per request more than at k = 0 (a second token verified per
    # request at 0.1 ms, and the draft pass): with a useless head a probe's regret is 2 x 0.35 ms at one
    # request and 2 x 5 ms at 32
    def policy():
        pol = SpeculationPolicy(k_max=2, warmup_cycles=1, probe_every=10, explore_budget=1.0)
        [pol.choose(32) for _ in range(6)]
        pol.cost = _cost(0.0002, 0.0001, 0.0002, 0.00005, 0.0002, 0.00005)
        pol.acceptance.observe([2] * 50, [0] * 50)
        return pol

    pol = policy()
    first = [pol.choose(32) for _ in range(11)]   # the probe falls due at step 17
    assert first == [0] * 11 and pol._probe_deferred and pol._hold is not None
    assert [pol.choose(1) for _ in range(3)] == [1, 1, 0]   # the first steady step at one request runs it
    # at one batch size only, the due probe runs one interval (10 steps) late; the interval then doubles
    pol = policy()
    later = [pol.choose(32) for _ in range(80)]
    assert [i for i, k in enumerate(later, start=7) if k] == [27, 28, 67, 68], later
    # and never from a k > 0 (the engine drafts here: this batch's own costs decide)
    pol = policy()
    [pol.choose(32) for _ in range(11)]
    assert pol._cheaper_at_a_smaller_batch(1, 0, 32) and not pol._cheaper_at_a_smaller_batch(1, 2, 32)
    with pytest.raises(ValueError, match="probe_cheaper_by"):
        SpeculationPolicy(k_max=2, probe_cheaper_by=0.5)


def test_an_exploration_the_step_itself_would_cut_short_waits_for_a_step_the_batch_stays_for():
    """Where the step brings its requests to their length cap (a rollout's requests reach max_tokens together),
    the next step runs in a smaller bucket and an exploration's second step, the one timed, would be dropped:
    a probe or a bucket's calibration due there waits for the next step whose requests stay. The engine is
    asked who stays only where an exploration would start."""
    asked = []

    def staying(n):
        return lambda: asked.append(n) or n

    pol = SpeculationPolicy(k_max=2, warmup_cycles=1, probe_every=10, explore_budget=1.0, probe_cheaper_by=math.inf)
    [pol.choose(32) for _ in range(6)]
    pol.cost = _cost(0.0002, 0.0001, 0.0002, 0.00005, 0.0002, 0.00005)
    pol.acceptance.observe([2] * 50, [0] * 50)
    assert [pol.choose(32, True, staying(32)) for _ in range(10)] == [0] * 10 and asked == []
    assert pol.choose(32, True, staying(31)) == 0 and asked == [31]   # due (step 17); 31 left: bucket 5
    assert pol.choose(32, True, staying(0)) == 0 and asked == [31, 0]   # every request ends here
    assert [pol.choose(32, True, staying(32)) for _ in range(3)] == [1, 1, 0] and asked == [31, 0, 32]
    pol._spent += 1.0   # a challenge of k = 2 that fits the budget: the same
    assert pol._challenge(0, 2, 32, staying(12)) == 0 and not pol._queue
    assert pol._challenge(0, 2, 32, staying(32)) == 2 and pol._queue == [2]
    assert not SpeculationPolicy._lasting(1, staying(0)) and SpeculationPolicy._lasting(1, staying(1))
    # a bucket timed at batch 1 only, where drafting may pay: its calibration waits the same way
    def truth(n, b, k):
        return 0.010 + 0.0002 * n + (k > 0) * (0.006 + 0.0002 * b) + max(k - 1, 0) * (0.004 + 0.0001 * b)

    pol = _timed_at_batch_one_only(truth, seed=0)
    pol.acceptance.observe([3] * 400, [3] * 380 + [1] * 20)
    asked.clear()
    assert [pol.choose(16, True, staying(n)) for n in (9, 16, 16, 16, 16, 16, 16, 16, 16, 16)] == [
        0, 0, 0, 1, 1, 2, 2, 3, 3, 0] and asked == [9, 16]
    assert pol._cycled == {5}


def test_probes_in_rl_rollouts_run_in_the_tail_and_cost_less_there():
    """RL rollouts shaped like the tiny default's (a full batch of 64 for 30 steps, then a tail through every
    smaller bucket), with a head accepted at 0.45 / 0.3 / 0.2 (k = 0 is the fastest everywhere): the probes
    that ran at 64 requests, where a draft step about doubles the step, wait for the tail, and exploring
    costs less of the engine's time."""
    alphas = [0.45, 0.3, 0.2]
    probes, regret = {}, {}
    for cheaper in (math.inf, 2.0):
        at_64, tail, lost = 0, 0, 0.0
        for seed in range(4):
            pol = SpeculationPolicy(k_max=3, probe_cheaper_by=cheaper)
            late = [s for s in _rl_rollouts(pol, random.Random(seed), alphas, 60, _tiny_default_step) if s[0] >= 10]
            at_64 += sum(1 for s in late if s[4] and s[1] == 64)
            tail += sum(1 for s in late if s[4] and s[1] < 32)
            lost += sum(_tiny_default_step(b, k) - expected_tokens(alphas, k) * _tiny_default_step(b, 0)
                        for _, b, k, explored, _ in late if explored) / sum(_tiny_default_step(s[1], s[2]) for s in late)
        probes[cheaper], regret[cheaper] = (at_64, tail), lost / 4
    assert probes[math.inf][0] >= 4 and probes[2.0][0] == 0 and probes[2.0][1] >= probes[math.inf][1], probes
    assert regret[2.0] < 0.92 * regret[math.inf], regret


def test_a_probe_waiting_for_its_budget_computes_its_regret_again_only_when_its_inputs_change(monkeypatch):
    """The due probe is asked about at every step until its budget accrues: its regret is computed once per
    change of what it depends on (the acceptance, the fit's solve, the settling), not per step."""
    from skyrl_mtp.speculation import policy as adaptive_speculation

    calls = []
    regret = adaptive_speculation.regret_seconds
    monkeypatch.setattr(adaptive_speculation, "regret_seconds", lambda *a: calls.append(a[2:]) or regret(*a))
    pol = SpeculationPolicy(k_max=2, warmup_cycles=1, probe_every=10, explore_budget=0.02)
    [pol.choose(4) for _ in range(6)]
    pol.cost = _costly_drafts()
    pol.acceptance.observe([2] * 50, [1] * 50)
    assert not any(pol.choose(4) for _ in range(500))   # due from the 10th step, affordable from the 801st
    assert calls == [(4, 1, 0)], calls
    pol.acceptance.observe([2] * 4, [0] * 4)            # new evidence: computed again, once
    assert not any(pol.choose(4) for _ in range(100))
    assert calls == [(4, 1, 0)] * 2, calls
    pol.observe_settle(0, 4, 4, 0.02)                    # the settling it is charged changed: again
    pol.choose(4)
    assert len(calls) == 3


def test_a_probe_waits_as_long_as_the_exploration_budget_is_small_and_never_runs_at_zero():
    def probed(budget):
        pol = SpeculationPolicy(k_max=2, warmup_cycles=1, probe_every=10, explore_budget=budget)
        [pol.choose(4) for _ in range(6)]
        pol.cost = _costly_drafts()
        pol.acceptance.observe([2] * 50, [1] * 50)
        return [i for i, k in enumerate((pol.choose(4) for _ in range(4000)), start=7) if k]
    # the same probe as above (0.1602 s of regret): 2% of the time allows one per 801 steps, 4% per 401,
    # 5% per 321; at 0 none runs (its regret is never covered)
    assert probed(0.04)[:2] == [6 + 401, 6 + 402]
    assert probed(0.05)[:2] == [6 + 321, 6 + 322]
    assert probed(0.0) == []


def test_explore_budget_reaches_the_engine_core_through_the_engine_environment():
    from skyrl_mtp.config.loader import load_config
    from skyrl_mtp.rollout.engine import engine_environment
    from skyrl_mtp.speculation.policy import EXPLORE_BUDGET_ENV
    from skyrl_mtp.trainer.run_plan import engine_config

    cfg = load_config(["recipe=tiny_dapo", "trainer.mtp.num_speculative_tokens=auto", "trainer.mtp.explore_budget=0.005"])
    env = engine_environment(engine_config(cfg, "/tmp/model"))
    assert explore_budget_from_env(env) == 0.005          # what the scheduler builds its policy with
    default = engine_environment(engine_config(load_config(["recipe=tiny_dapo", "trainer.mtp.num_speculative_tokens=auto"]),
                                               "/tmp/model"))
    assert explore_budget_from_env(default) == 0.02 == SpeculationPolicy.explore_budget
    fixed = engine_environment(engine_config(load_config(["recipe=tiny_dapo"]), "/tmp/model"))
    assert EXPLORE_BUDGET_ENV not in fixed                 # a fixed k has no policy to give it to
    assert explore_budget_from_env({}) == SpeculationPolicy.explore_budget
    for bad in ("0.7", "-0.1", "lots", "nan"):
        with pytest.raises(AdaptiveSpeculationError, match=f"{EXPLORE_BUDGET_ENV}='{bad}' is invalid"):
            explore_budget_from_env({EXPLORE_BUDGET_ENV: bad})
    with pytest.raises(ValueError, match="explore_budget=1.5"):
        SpeculationPolicy(k_max=3, explore_budget=1.5)


def test_explorations_start_on_steady_steps_and_stay_in_the_bucket_they_were_chosen_for():
    """Rollouts as an RL engine sees them: prompt steps while the requests arrive (not timed), decode steps at
    64 requests, then a tail at 8 and 2. With probes due at every chance, no exploration starts on a prompt
    step, and none runs on in a bucket other than its own (its regret was charged at that batch)."""
    def seconds(k):
        return 0.006 + (k > 0) * 0.006 + max(k - 1, 0) * 0.002
    rng = random.Random(0)
    pol = SpeculationPolicy(k_max=3, probe_every=1, probe_every_max=1, explore_budget=1.0)
    _engine(pol, rng, 64, [0.0] * 3, pol.warmup_steps, seconds)
    rollout = [(1, False), (16, False), (64, False)] + [(64, True)] * 12 + [(8, True), (2, True)]
    runs, prev = [], -1
    for _ in range(20):
        for batch, steady in rollout:
            k = pol.choose(batch, steady)
            if steady and k == prev:
                pol.cost.observe(batch * (1 + k), batch, k, seconds(k) * math.exp(rng.gauss(0.0, 0.1)))
            runs.append((batch, steady, k))
            prev = k
    assert sum(k > 0 for _, _, k in runs) >= 20                    # probes ran, on the steady steps
    assert all(k == 0 for _, steady, k in runs if not steady), runs
    for (b1, _, k1), (b2, _, k2) in zip(runs, runs[1:]):
        if k1 > 0 and k2 > 0:
            assert bucket(b1) == bucket(b2), runs


def test_regret_counts_the_tokens_a_step_gives_up_as_well_as_its_time():
    cost = _cost(t0=0.010, t1=0.0, d0=0.002, d1=0.0, e0=0.002, e1=0.0)   # 0.010 s + 0.002 s per draft step
    perfect, useless = [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]
    # from k = 2 with every draft accepted (3 tokens per 0.014 s): a shallower step is cheaper, yet loses
    assert regret_seconds(perfect, cost, 4, 1, 2) == pytest.approx(0.012 - 0.014 * 2 / 3, rel=1e-2)
    assert regret_seconds(perfect, cost, 4, 0, 2) == pytest.approx(0.010 - 0.014 / 3, rel=1e-2)
    assert regret_seconds(perfect, cost, 4, 2, 2) == 0.0
    assert regret_seconds(perfect, cost, 4, 3, 0) == 0.0    # accepted drafts pay for the time they take
    assert regret_seconds(useless, cost, 4, 3, 0) == pytest.approx(0.016 - 0.010, rel=1e-2)   # their time


def test_a_shallower_probe_is_not_free_where_the_deepest_k_pays():
    pol = SpeculationPolicy(k_max=3, warmup_cycles=1, probe_every=4, explore_budget=0.02)
    [pol.choose(1) for _ in range(8)]
    pol.cost = _cost(t0=0.010, t1=0.0, d0=0.002, d1=0.0, e0=0.002, e1=0.0)
    pol.acceptance.observe([3] * 200, [3] * 200)
    ks = [pol.choose(1) for _ in range(200)]
    # k = 3 emits ~4 tokens per 0.016 s; a probe at k = 2 emits ~3 in 0.014 s, which k = 3 gives in
    # 0.012 s: 2 x 0.0020 s of regret, 2% of the time after 12.5 steps (probe_every alone: after 4)
    probed = [i for i, k in enumerate(ks) if k != 3]
    assert probed[:2] == [12, 13] and all(ks[i] == 2 for i in probed[:2]), ks


def test_a_new_bucket_is_not_calibrated_where_drafts_cost_too_much():
    pol = SpeculationPolicy(k_max=2, warmup_cycles=1, probe_every=0)
    [pol.choose(4) for _ in range(6)]
    pol.cost = _costly_drafts(batches=(1, 4, 16))
    pol.acceptance.observe([2] * 50, [2] * 50)   # a perfect head: 3 tokens per step at k = 2, for 16x the cost
    assert [pol.choose(64) for _ in range(4)] == [0, 0, 0, 0]
    assert pol.stats()["calibrated_buckets"] == [1, 3, 5] and not pol._cycled


def test_a_new_buckets_calibration_waits_for_the_exploration_budget_when_drafting_only_might_pay():
    pol = SpeculationPolicy(k_max=2, warmup_cycles=1, probe_every=0, explore_budget=0.02)
    [pol.choose(4) for _ in range(6)]
    # a draft step costs 30% of a plain one, and a weak head: k = 0 is best, k = 1 within 25% of it
    pol.cost = _cost(t0=0.010, t1=0.0, d0=0.00305, d1=0.0, e0=0.00305, e1=0.0, batches=(1, 2, 4, 8, 16, 32))
    pol.acceptance.observe([2] * 400, [0] * 300 + [1] * 100)
    best, rates = best_k(pol.acceptance.rates(), pol.cost, 64, 2)
    assert best == 0 and rates[1] >= 0.75 * rates[0], rates
    ks = [pol.choose(64) for _ in range(120)]
    # the cycle's regret (2 steps at k=2, 2 at k=1, each beyond what k = 0 needs for their tokens:
    # ~0.0083 s) fits 2% of the engine time after ~41 plain 0.010 s steps; only then is the bucket timed
    # at every k, once, the k it runs at (0) first
    start = ks.index(1) - 2
    assert 38 <= start <= 46, start
    assert ks[start:start + 6] == [0, 0, 1, 1, 2, 2] and not any(ks[:start]) and not any(ks[start + 6:])
    assert pol._cycled == {7}


def _timed_at_batch_one_only(truth, seed: int) -> SpeculationPolicy:
    """A policy past its warm-up whose cost fit has timed 300 steps (+-20% noise, k drawn at random) at
    batch 1 and at no other batch."""
    rng = random.Random(seed)
    pol = SpeculationPolicy(k_max=3, warmup_cycles=3, probe_every=0)
    [pol.choose(1) for _ in range(pol.warmup_steps)]
    for _ in range(300):
        k = rng.choice(range(4))
        pol.cost.observe(1 + k, 1, k, truth(1 + k, 1, k) * rng.uniform(0.8, 1.25))
    return pol


def test_a_bucket_the_fit_can_only_extrapolate_to_is_calibrated_at_once_where_drafting_may_pay():
    # drafts cost mostly a fixed 6 ms + 4 ms per extra step; timed (with +-20% noise) at batch 1 only, the
    # fit cannot tell fixed from per-request cost and predicts batch 16 several times too dear
    def truth(n, b, k):
        return 0.010 + 0.0002 * n + (k > 0) * (0.006 + 0.0002 * b) + max(k - 1, 0) * (0.004 + 0.0001 * b)

    pol = _timed_at_batch_one_only(truth, seed=0)
    pol.acceptance.observe([3] * 400, [3] * 380 + [1] * 20)
    alphas = pol.acceptance.rates()
    _, rates = best_k(alphas, pol.cost, 16, 3)
    assert max(rates[1:]) < 0.75 * rates[0], rates            # on its mean prediction drafting cannot pay
    true_rates = [expected_tokens(alphas, k) / truth(16 * (1 + k), 16, k) for k in range(4)]
    assert max(true_rates) == true_rates[3] > 1.15 * true_rates[0], true_rates   # yet it does
    # one standard error in drafting's favour does not rule it out: the cycle runs at once, not after the
    # hundreds of steps the mean's regret would take to fit the budget
    assert [pol.choose(16) for _ in range(10)] == [0, 0, 1, 1, 2, 2, 3, 3, 0, 0]
    assert pol._cycled == {5}


def test_an_extrapolated_bucket_is_not_calibrated_where_drafts_already_cost_too_much_at_a_smaller_batch():
    # a draft step costs 3 plain steps at batch 1 (timed with +-20% noise), and a weak head: whatever the
    # fit's doubt about batch 16, drafting for 16 requests costs no less, so no cycle is spent there
    def truth(n, b, k):
        return 0.010 + 0.0002 * n + (k > 0) * 0.030 + max(k - 1, 0) * 0.030

    pol = _timed_at_batch_one_only(truth, seed=1)
    pol.acceptance.observe([3] * 400, [0] * 280 + [1] * 120)
    assert pol.cost.difference_sd(16, 1, 0) > pol.cost.step_seconds(16, 1) - pol.cost.step_seconds(16, 0)
    assert pol.cost.draft_seconds_floor(16, 1) == pytest.approx(0.030, rel=0.2)
    assert [pol.choose(16) for _ in range(10)] == [0] * 10 and not pol._cycled


def test_dynamic_schedule_covers_every_batch_size():
    assert dynamic_schedule(3, 64) == [(1, 64, 3)]


def test_policy_rejects_a_zero_maximum():
    with pytest.raises(ValueError, match="k_max=0"):
        SpeculationPolicy(k_max=0)


def test_install_fails_loudly_when_vllm_moved():
    class Runner:   # no propose_draft_token_ids, no drafter
        def execute_model(self, scheduler_output):
            return None

    pytest.importorskip("vllm")
    with pytest.raises(AdaptiveSpeculationError, match="propose_draft_token_ids"):
        install(Runner())


def test_the_worker_accepts_the_adaptive_scheduler_or_a_subclass_and_nothing_else():
    pytest.importorskip("vllm")
    import sys
    import types

    from skyrl_mtp.speculation.policy import SCHEDULER_CLS, _is_adaptive_scheduler
    from skyrl_mtp.speculation.scheduler_hook import AdaptiveSpeculationScheduler

    module = types.ModuleType("skyrl_test_schedulers")
    module.Timed = type("Timed", (AdaptiveSpeculationScheduler,), {})
    module.Other = type("Other", (), {})
    sys.modules[module.__name__] = module
    try:
        assert _is_adaptive_scheduler(SCHEDULER_CLS) and _is_adaptive_scheduler(AdaptiveSpeculationScheduler)
        assert _is_adaptive_scheduler("skyrl_test_schedulers.Timed") and _is_adaptive_scheduler(module.Timed)
        for other in ("skyrl_test_schedulers.Other", "vllm.v1.core.sched.scheduler.Scheduler", "no_such.Module",
                      "skyrl_test_schedulers.Missing", None, "Scheduler"):
            assert not _is_adaptive_scheduler(other), other
    finally:
        del sys.modules[module.__name__]


def test_auto_reaches_the_engine_config_with_its_maximum():
    from skyrl_mtp.config.loader import load_config
    from skyrl_mtp.trainer.run_plan import engine_config, train_depths

    cfg = load_config(["recipe=tiny_dapo", "trainer.mtp.num_speculative_tokens=auto",
                       "trainer.mtp.max_speculative_tokens=4"])
    ec = engine_config(cfg, "/tmp/model")
    assert ec.adaptive_speculation is True and ec.num_speculative_tokens == 4
    assert ec.speculative_config["num_speculative_tokens_per_batch_size"] == [(1, ec.max_num_seqs, 4)]
    managed = ec.managed_engine_kwargs("m.C")
    assert managed["scheduler_cls"] == "skyrl_mtp.speculation.scheduler_hook.AdaptiveSpeculationScheduler"
    assert managed["async_scheduling"] is False
    assert train_depths(cfg) == 4    # depth-aware training up to the maximum k
    fixed = engine_config(load_config(["recipe=tiny_dapo", "trainer.mtp.num_speculative_tokens=2"]), "/tmp/model")
    assert fixed.adaptive_speculation is False and "num_speculative_tokens_per_batch_size" not in fixed.speculative_config
    assert fixed.managed_engine_kwargs("m.C")["scheduler_cls"] is None     # vLLM's own scheduler
    assert fixed.managed_engine_kwargs("m.C")["async_scheduling"] is None  # vLLM decides


@pytest.mark.parametrize("overrides, named", [
    (["trainer.mtp.num_speculative_tokens=banana"], "trainer.mtp.num_speculative_tokens='banana'"),
    (["trainer.mtp.num_speculative_tokens=auto", "trainer.mtp.max_speculative_tokens=0"],
     "trainer.mtp.max_speculative_tokens=0"),
    (["trainer.mtp.num_speculative_tokens=auto", "trainer.mtp.explore_budget=0.9"],
     "trainer.mtp.explore_budget=0.9 is invalid: must be a share of engine time in"),
    (["trainer.mtp.num_speculative_tokens=auto", "trainer.mtp.explore_budget=-0.01"],
     "trainer.mtp.explore_budget=-0.01 is invalid"),
    (["trainer.mtp.num_speculative_tokens=2", "trainer.mtp.explore_budget=0.01"],
     "trainer.mtp.explore_budget=0.01 is invalid: applies only with trainer.mtp.num_speculative_tokens=auto"),
])
def test_bad_speculation_keys_are_named(overrides, named):
    from skyrl_mtp.config.loader import load_config
    from skyrl_mtp.errors import ConfigError

    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(["recipe=tiny_dapo", *overrides])


def test_probabilistic_drafting_reaches_vllm_and_warns_about_the_coupling():
    from skyrl_mtp.config.loader import load_config
    from skyrl_mtp.trainer.run_plan import engine_config

    cfg = load_config(["recipe=tiny_dapo", "trainer.mtp.draft_sample_method=probabilistic", "trainer.mtp.loss_type=tv"])
    with pytest.warns(UserWarning, match="draft-invariant coupling does not cover"):
        ec = engine_config(cfg, "/tmp/model")
    assert ec.speculative_config["draft_sample_method"] == "probabilistic"
    greedy = engine_config(load_config(["recipe=tiny_dapo"]), "/tmp/model")
    assert "draft_sample_method" not in greedy.speculative_config


def test_engine_core_skips_the_draft_fetch_after_a_step_that_drafted_nothing():
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from vllm.v1.engine.core import EngineCore

    from skyrl_mtp.speculation.scheduler_hook import (
        AdaptiveSpeculationScheduler,
        _Step,
        install_post_step_guard,
    )

    install_post_step_guard()
    wrapped = EngineCore.post_step
    install_post_step_guard()
    assert EngineCore.post_step is wrapped          # once per process

    fetched = []
    sched = object.__new__(AdaptiveSpeculationScheduler)   # only the parts post_step touches
    sched.speculation, sched._step, sched.fetches_skipped = SpeculationPolicy(k_max=2), None, 0
    sched.update_draft_token_ids = lambda d: fetched.append(d)
    core = SimpleNamespace(scheduler=sched, check_for_draft_tokens=True, async_scheduling=False,
                           model_executor=SimpleNamespace(take_draft_token_ids=lambda: "drafts"))
    sched._step = _Step(t0=0.0, num_tokens=4, batch=4, k=0, timed=True)
    EngineCore.post_step(core, True)
    assert fetched == [] and sched.fetches_skipped == 1 and sched._step is None
    sched._step = _Step(t0=0.0, num_tokens=4, batch=4, k=2, timed=True)
    EngineCore.post_step(core, True)
    assert fetched == ["drafts"] and sched.fetches_skipped == 1
    other = SimpleNamespace(scheduler=SimpleNamespace(update_draft_token_ids=lambda d: fetched.append(d)),
                            check_for_draft_tokens=True, async_scheduling=False,
                            model_executor=SimpleNamespace(take_draft_token_ids=lambda: "vllm"))
    EngineCore.post_step(other, True)              # vLLM's own scheduler: untouched behaviour
    assert fetched == ["drafts", "vllm"]


def test_idle_head_budget_reaches_the_loop_only_when_the_depths_follow_the_engines():
    from skyrl_mtp.config.loader import load_config
    from skyrl_mtp.errors import ConfigError
    from skyrl_mtp.trainer.run_plan import loop_config

    auto = loop_config(load_config(["recipe=tiny_dapo", "trainer.mtp.num_speculative_tokens=auto"]))
    assert auto.head_max_depths == 3 and auto.idle_head_train_budget == 0.01
    fixed_depths = loop_config(load_config(["recipe=tiny_dapo", "trainer.mtp.num_speculative_tokens=auto",
                                            "trainer.mtp.train_depths=2"]))
    assert fixed_depths.head_max_depths is None and fixed_depths.idle_head_train_budget == 1.0
    fixed_k = loop_config(load_config(["recipe=tiny_dapo", "trainer.mtp.num_speculative_tokens=2"]))
    assert fixed_k.head_max_depths is None and fixed_k.idle_head_train_budget == 1.0
    for bad in ("0", "1.5", "-0.01"):
        with pytest.raises(ConfigError, match=rf"trainer\.mtp\.idle_head_train_budget={bad}.*in \(0, 1\]"):
            load_config(["recipe=tiny_dapo", f"trainer.mtp.idle_head_train_budget={bad}"])


def test_a_verified_step_is_credited_what_its_accepted_drafts_saved_at_the_fitted_costs():
    # steps cost 10 ms plain and 4 ms more per draft at batch 8: two drafts accepted per request save two
    # plain steps (20 ms) for 8 ms of drafting; none accepted cost the 8 ms
    assert step_savings([0.010, 0.014, 0.018], 2, 2.0) == pytest.approx(0.012)
    assert step_savings([0.010, 0.014, 0.018], 2, 0.0) == pytest.approx(-0.008)
    assert step_savings([0.010, 0.014, 0.018], 1, 0.5) == pytest.approx(0.001)
    pol = SpeculationPolicy(k_max=2)
    for _ in range(6):
        for k in range(3):
            pol.cost.observe(8 * (1 + k), 8, k, 0.010 + 0.004 * k)
    costs = pol.cost.monotone_step_seconds(8)
    assert costs == pytest.approx([0.010, 0.014, 0.018], rel=1e-3)
    assert pol.credit_verified(8, [2] * 8, [2] * 8) == pytest.approx(0.012, rel=1e-2)
    # half the batch carried drafts, one of each two accepted: 4 tokens gained over 8 requests
    assert pol.credit_verified(8, [2] * 4, [1] * 4) == pytest.approx(0.5 * costs[0] - (costs[2] - costs[0]))
    assert pol.credit_verified(8, [0] * 8, [0] * 8) == 0.0          # nothing drafted: nothing to credit
    assert pol.seconds_saved == pytest.approx(0.012 + 0.5 * costs[0] - (costs[2] - costs[0]), rel=1e-2)
    assert pol.stats()["seconds_saved"] == pol.seconds_saved


def _rl_rollouts(pol: SpeculationPolicy, rng: random.Random, alphas: list[float], rollouts: int, seconds):
    """The engine steps of RL rollouts as the tiny default runs them: requests arriving (prompt steps, not
    steady) at batch 1 then 64, 30 decode steps at 64, then a tail passing through every smaller bucket in
    one to three steps each. Returns (rollout, batch, k, explored, a probe started) per step."""
    shape = [(1, False)] + [(64, False)] * 3 + [(64, True)] * 30 + [
        (b, True) for b in (40, 32, 20, 16, 12, 8, 6, 4, 3, 2, 2, 1, 1, 1)]
    out, prev = [], -1
    for r in range(rollouts):
        for batch, steady in shape:
            explored, probes = pol.explored_steps, pol._probe
            k = pol.choose(batch, steady)
            if k:
                pol.acceptance.observe([k] * batch, _accepted(rng, alphas, k, batch))
            if steady and k == prev and pol.timing_valid:
                pol.cost.observe(batch * (1 + k), batch, k, seconds(batch, k) * math.exp(rng.gauss(0.0, 0.1)))
            out.append((r, batch, k, pol.explored_steps > explored, pol._probe > probes))
            prev = k
    return out


def _tiny_default_step(batch: int, k: int) -> float:
    """Step times shaped like the tiny default's on 2 CPU cores (k = 0: 2.5 ms at batch 1, 7.8 ms at 64; a
    first draft step ~2.5 ms + 0.12 ms per request, each further one ~0.8 ms + 0.02 ms per request)."""
    t = 2.4 + 0.085 * batch
    if k:
        t += 2.5 + 0.12 * batch + (k - 1) * (0.8 + 0.02 * batch)
    return t / 1000


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_rollouts_tail_gets_every_bucket_timed_and_stops_drafting_where_it_does_not_pay(seed):
    # a head accepted at 0.75 / 0.6 / 0.5: k = 0 is the fastest at every batch size here. The tail passes
    # through each small bucket in 1-3 steps, so a calibration cycle there is always cut short; one that
    # started over at k_max every time kept the tail buckets untimed at k < k_max, judged on the fit over
    # all batches (which extrapolated k = 0 from batch 64 at ~1.6x its cost) and drafting at k = 3 there
    alphas = [0.75, 0.6, 0.5]
    assert all(min(range(4), key=lambda k: _tiny_default_step(b, k) / expected_tokens(alphas, k)) == 0
               for b in range(1, 65))
    pol = SpeculationPolicy(k_max=3)
    steps = _rl_rollouts(pol, random.Random(seed), alphas, 40, _tiny_default_step)
    assert pol.cost.covered_buckets() == [1, 2, 3, 4, 5, 6, 7]
    late = [s for s in steps if s[0] >= 30]
    drafted = [s for s in late if s[2] > 0]
    assert len(drafted) <= 0.02 * len(late), drafted
    assert all(pol._incumbent[b] == 0 for b in range(1, 8)), pol._incumbent
    # a bucket's choice is its own: the tail moving through buckets is not the choice moving, so the probes
    # keep backing off
    assert sum(s[3] for s in late) <= 0.02 * len(late), sum(s[3] for s in late)


def _rollouts_to_follow(pol: SpeculationPolicy, seed: int, good: list[float], limit: int) -> int | None:
    """Ten RL rollouts with a head that is never accepted, then `limit` with one accepted at `good` (new
    weights before each): the first of those in which the steps where some k > 0 is the fastest drafted on
    at least half of them (counted from 1), or None."""
    rng = random.Random(seed)
    _rl_rollouts(pol, rng, [0.0] * pol.k_max, 10, _tiny_default_step)
    pays = {b for b in range(1, 65)
            if min(range(pol.k_max + 1), key=lambda k: _tiny_default_step(b, k) / expected_tokens(good, k)) > 0}
    for r in range(1, limit + 1):
        pol.on_new_weights()
        steps = [s for s in _rl_rollouts(pol, rng, good, 1, _tiny_default_step) if s[1] in pays]
        if sum(s[2] > 0 for s in steps) >= 0.5 * len(steps):
            return r
    return None


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_at_the_default_budget_a_head_that_starts_paying_is_followed_within_a_few_rollouts(seed):
    # the closed loop: ten rollouts of an untrained head leave every bucket at k = 0 with the acceptance
    # estimate near 0; the exploration budget pays for the probes that find the trained head (4-7 rollouts for
    # these seeds, with the tail's buckets to calibrate once it is found)
    good = [0.95, 0.95, 0.95]
    followed = _rollouts_to_follow(SpeculationPolicy(k_max=3), seed, good, 12)
    assert followed is not None and followed <= 10, followed
    # nothing explored where it is predicted to cost: the untrained head's k = 0 is never left
    assert _rollouts_to_follow(SpeculationPolicy(k_max=3, explore_budget=0.0), seed, good, 12) is None


def test_the_fits_plain_python_algebra_matches_numpys():
    """OnlineLinearFit solves in plain Python (numpy is slow in the engine core between model steps): its
    inverse, weights and standard errors are numpy's to rounding."""
    from skyrl_mtp.speculation.policy import _spd_inverse

    rng = np.random.default_rng(0)
    m = rng.normal(size=(6, 6))
    a = m @ m.T + 0.1 * np.eye(6)
    assert np.allclose(_spd_inverse(a.tolist()), np.linalg.inv(a), rtol=1e-9, atol=1e-12)
    fit = OnlineLinearFit(6, decay=0.99)
    samples = []
    for _ in range(300):
        k = int(rng.integers(0, 2))   # k <= 1: the last two features (k >= 2) stay unseen
        b = int(rng.integers(1, 64))
        x = step_features(b * (1 + k), b, k)
        y = 0.004 + 1e-4 * b * (1 + k) + 0.002 * (k > 0) + 1e-3 * rng.random()
        fit.add(x, y)
        samples.append((x, y))
    xs = np.asarray([x for x, _ in samples])
    ys = np.asarray([y for _, y in samples])
    wts = 0.99 ** np.arange(len(samples) - 1, -1, -1)
    xtx, xty = (xs * wts[:, None]).T @ xs, (xs * wts[:, None]).T @ ys
    seen = np.diag(xtx) > 0
    assert seen.tolist() == [True] * 4 + [False] * 2
    inv = np.linalg.inv(xtx[np.ix_(seen, seen)] + np.diag(fit.ridge * np.diag(xtx)[seen]))
    w = np.zeros(6)
    w[seen] = inv @ xty[seen]
    assert fit.weights() == pytest.approx(w.tolist(), rel=1e-7, abs=1e-12)
    rss = float((wts * ys * ys).sum() - 2 * w @ xty + w @ xtx @ w)
    var = rss / (fit.weight - 6)
    xa, xb = step_features(40, 20, 1), step_features(20, 20, 0)
    d = (np.asarray(xa) - np.asarray(xb))[seen]
    assert fit.difference_sd(xa, xb) == pytest.approx(math.sqrt(d @ inv @ d * var), rel=1e-6)
    assert fit.difference_sd(step_features(80, 20, 3), xb) == math.inf   # along an unseen feature


def _choice_computed_per_batch(pol: SpeculationPolicy, batch: int) -> tuple[int, int, float]:
    """_model_choice's (best, rival, step time) as computed for this batch size alone."""
    alphas = pol.acceptance.rates()
    best, rates = best_k(alphas, pol.cost, batch, pol.k_max, pol._incumbent.get(bucket(batch), 0))
    if best and not pol.cost.covers(batch):
        best = 0
    return best, plausible_rival(alphas, pol.cost, batch, pol.k_max, best, rates), pol.cost.step_seconds(batch, best)


@pytest.mark.parametrize(("alphas", "at_least"), [([0.0, 0.0, 0.0], 200), ([0.75, 0.6, 0.5], 15),
                                                  ([0.9, 0.85, 0.8], 0), ([0.99, 0.99, 0.99], 0)])
def test_a_choice_settled_across_its_bucket_is_the_one_each_batch_size_would_get(alphas, at_least):
    """Where not drafting is settled across a bucket (settled_across), _model_choice answers a new batch size
    of it without computing it again: its k, rival (none) and step time are bit-identical to the per-batch
    computation at every step of RL rollouts, at acceptances where the engine stops drafting (where it takes
    the shortcut, `at_least` times), drafts deeply, and in between."""
    pol = SpeculationPolicy(k_max=3, max_batch=64)
    rng = random.Random(0)
    shortcuts = []
    line_seconds = pol.cost.line_seconds
    pol.cost.line_seconds = lambda batch, k: shortcuts.append(batch) or line_seconds(batch, k)   # a spy
    shape = [(1, False)] + [(64, False)] * 3 + [(64, True)] * 20 + [
        (b, True) for b in (63, 60, 52, 47, 40, 36, 32, 29, 20, 18, 16, 12, 9, 8, 7, 6, 5, 4, 3, 2, 2, 1, 1)]
    prev = -1
    for _ in range(30):
        pol.on_new_weights()
        for batch, steady in shape:
            expected = _choice_computed_per_batch(pol, batch)
            assert pol._model_choice(batch) == expected[0]
            assert pol._memo[1] == expected
            k = pol.choose(batch, steady)
            if k:
                pol.acceptance.observe([k] * batch, _accepted(rng, alphas, k, batch))
            if steady and k == prev and pol.timing_valid:
                pol.cost.observe(batch * (1 + k), batch, k, _tiny_default_step(batch, k) * math.exp(rng.gauss(0, 0.1)))
            prev = k
    assert len(shortcuts) >= at_least, len(shortcuts)   # the shortcut was taken, not only the per-batch path


def test_settled_across_refuses_a_bucket_where_the_answer_changes_inside_it():
    """Drafting pays at the small end of a bucket and not at the large end: no single answer holds there."""
    cost = _cost(0.010, 1e-4, 0.001, 7e-5, 0.010, 1e-4, batches=(32, 40, 48, 56, 63))
    alphas = [0.6, 0.5, 0.4]
    answers = {best_k(alphas, cost, b, 3, 0)[0] for b in range(32, 64)}
    assert len(answers) > 1, answers
    assert not any(settled_across(alphas, cost, 32, 63, 3, k) for k in range(4))


# ---- settling after an exploration ---------------------------------------------------------------

def test_the_settling_steps_are_the_plain_steps_after_the_one_that_verifies_the_last_drafts():
    pol = SpeculationPolicy(k_max=2)

    def track(seq):
        out = []
        for k, explored in seq:
            pol._track_settling(k, explored)
            out.append(pol.settling)
        return out

    assert track([(0, False)] * 3) == [-1, -1, -1]              # nothing drafted yet: nothing to settle from
    # a probe (explored, k = 2 twice), the verify step back, three settling steps, then plain steps again
    assert track([(2, True), (2, True)] + [(0, False)] * 6) == [-1, -1, -1, 0, 1, 2, -1, -1]
    # a calibration cycle's queued k = 0 steps count along but stay the fit's timings (not settling)
    assert track([(1, True), (0, True), (0, True), (0, False), (0, False)]) == [-1, -1, -1, 1, 2]
    # the model's own move back to k = 0 after drafting settles as well
    assert track([(1, False), (0, False), (0, False)]) == [-1, -1, 0]
    with pytest.raises(ValueError, match="settle_steps=-1"):
        SpeculationPolicy(k_max=2, settle_steps=-1)


def _timed_every_k(pol: SpeculationPolicy, batch: int, seconds) -> None:
    for _ in range(4):
        for k in range(pol.k_max + 1):
            pol.cost.observe(batch * (1 + k), batch, k, seconds(k))


def test_observe_settle_averages_the_excess_over_k0_per_position_and_clips_stalls():
    pol = SpeculationPolicy(k_max=2)
    _timed_every_k(pol, 8, lambda k: 0.005 + 0.004 * (k > 0) + 0.001 * k)
    assert pol.settle_seconds == 0.0
    pol.observe_settle(0, 8, 8, 0.0072)
    assert pol.settle_excess[0] == pytest.approx(0.0022, abs=1e-5) and pol.settle_seconds == pytest.approx(0.0022, abs=1e-5)
    pol.observe_settle(0, 8, 8, 0.0062)                     # a decayed mean of the two
    assert 0.0012 < pol.settle_excess[0] < 0.0017
    pol.observe_settle(2, 8, 8, 0.004)                      # faster than k = 0's fit: no credit
    assert pol.settle_excess[2] < 0 and pol.settle_seconds == pytest.approx(pol.settle_excess[0])
    pol.observe_settle(1, 8, 8, 1.0)                        # a stall counts as 1.5x the prediction
    assert pol.settle_excess[1] == pytest.approx(0.5 * 0.005, rel=0.01)
    with pytest.raises(ValueError, match="settle position 3"):
        pol.observe_settle(3, 8, 8, 0.005)
    assert pol.stats()["settle_seconds"] == pol.settle_seconds


def test_an_exploration_from_k0_is_charged_its_settling():
    pol = SpeculationPolicy(k_max=2)
    _timed_every_k(pol, 8, lambda k: 0.005 + 0.004 * (k > 0) + 0.001 * k)
    pol.acceptance.observe([2] * 8, [0] * 8)
    regret = 2 * regret_seconds(pol.acceptance.rates(), pol.cost, 8, 1, 0)
    pol._spent = (regret + 0.001) / pol.explore_budget                 # the budget covers the steps' regret
    assert pol._two_steps_affordable(1, 0, 8)
    for position in range(3):
        pol.observe_settle(position, 8, 8, 0.0055)                     # +0.5 ms each: 1.5 ms an exploration
    assert pol.settle_seconds == pytest.approx(0.0015, rel=0.01)
    assert not pol._two_steps_affordable(1, 0, 8)                       # not with what the settling adds
    pol._spent = (regret + 0.0015 + 0.0001) / pol.explore_budget
    assert pol._two_steps_affordable(1, 0, 8)
    assert pol._two_steps_affordable(0, 1, 8) == (2 * regret_seconds(pol.acceptance.rates(), pol.cost, 8, 0, 1)
                                                  <= pol.explore_budget * pol._spent)   # from k > 0: no settling


def _engine_that_settles(pol: SpeculationPolicy, rng: random.Random, batch: int, steps: int, seconds,
                         penalty: float) -> int:
    """The stand-in engine of `_engine`, whose 2nd-4th plain steps after a step that drafted take `penalty`
    longer, timed as the scheduler times them (settling steps to observe_settle). Returns the steps the
    policy explored."""
    prev, back = -1, 99
    for _ in range(steps):
        k = pol.choose(batch)
        settle = pol.settling
        if k:
            pol.acceptance.observe([k] * batch, _accepted(rng, [0.2, 0.1], k, batch))
        back = 0 if k else back + 1
        t = seconds(k) * math.exp(rng.gauss(0.0, 0.03)) + (penalty if 2 <= back <= 4 else 0.0)
        if pol.timing_valid and settle >= 0:
            pol.observe_settle(settle, batch, batch, t)
        elif pol.timing_valid and k == prev:
            pol.cost.observe(batch * (1 + k), batch, k, t)
        prev = k
    return pol.explored_steps


@pytest.mark.parametrize("seed", range(3))
def test_settling_slows_the_explorations_where_they_cost_more_than_their_steps(seed):
    def seconds(k):
        return 0.005 + 0.004 * (k > 0) + 0.001 * k

    def run(penalty):
        pol = SpeculationPolicy(k_max=2, probe_every=16, probe_every_max=16)
        explored = _engine_that_settles(pol, random.Random(seed), 8, 3000, seconds, penalty)
        return pol, explored

    quiet, explored_quiet = run(0.0)
    slow, explored_slow = run(0.002)
    assert slow.settle_seconds == pytest.approx(0.006, rel=0.1)         # 3 steps x 2 ms, measured
    assert quiet.settle_seconds < 0.0015
    assert explored_slow < 0.8 * explored_quiet, (explored_slow, explored_quiet)
    assert slow.histogram[0] > 0.9 * sum(slow.histogram)                  # k = 0 stays the choice


# ---- choose's fast path ----------------------------------------------------------------------------

# an RL rollout as the engine meets it: requests arriving, a long stretch at a full batch, a tail draining
# through every bucket
ONE_WAVE = [(1, False), (40, False), (64, False)] + [(64, True)] * 40 + [(63, True)] * 5 + [(61, True)] * 3 + [
    (b, True) for b in (58, 58, 50, 47, 47, 40, 36, 33, 33, 32, 29, 20, 18, 16, 12, 9, 8, 7, 6, 5, 4, 3, 2, 2, 1, 1)]
# dynamic sampling's second round arriving while the first drains: prompt steps in the middle of a rollout, and a
# batch that comes back to buckets it has left
TWO_WAVES = ONE_WAVE[:60] + [(24, True)] * 6 + [(40, False), (56, False)] + [(56, True)] * 20 + [(60, False)] + [
    (b, True) for b in (60, 60, 44, 44, 30, 30, 30, 14, 14, 6, 6, 6, 2, 1)]


def _random_rollout(rng: random.Random) -> list[tuple[int, bool]]:
    """A rollout of 64 requests whose lengths vary: prompt steps as they arrive, then decode steps as they finish
    (several in one step, or none for a while), and now and then a second round arriving while the first
    drains (prompt steps in the middle, a batch that climbs back into buckets it left)."""
    steps: list[tuple[int, bool]] = [(b, False) for b in sorted(rng.sample(range(1, 64), rng.randint(0, 2))) + [64]]
    batch = 64
    while batch:
        steps += [(batch, True)] * rng.randint(1, 12)
        if rng.random() < 0.06 and batch < 48:
            batch = min(64, batch + rng.randint(4, 40))
            steps.append((batch, False))
        else:
            batch = max(0, batch - rng.choice((0, 1, 1, 2, 3, 5, 8, batch // 2 + 1)))
    return steps


def _lockstep(alphas: list[float] | Callable[[int], list[float]], seed: int, rollouts: int,
              shape: list[tuple[int, bool]] | None = ONE_WAVE, **policy: Any) -> tuple[SpeculationPolicy, SpeculationPolicy]:
    """Two policies fed the same engine, step by step: RL rollouts of `shape` (batch, steady) steps (None: a
    random rollout each, _random_rollout), a weight sync before each (`alphas`: the head's acceptance per
    position, or a function of the rollout giving it), each step's drafts verified by the next one (its
    acceptance observed after that step's choice), timed as the scheduler times them (settling steps to
    observe_settle, steady steps to the cost fit, noisy with a stall now and then; the requests that stay are
    those of the next step). The second runs its full choice at every step (its fast path's records are
    dropped before each). `policy`: SpeculationPolicy's settings beyond k_max = 3 and max_batch = 64."""
    fast, full = (SpeculationPolicy(k_max=3, max_batch=64, **policy) for _ in range(2))
    rngs = [random.Random(seed), random.Random(seed)]
    prev, drafted_by = [-1, -1], [0, 0]
    head = alphas if callable(alphas) else (lambda _: alphas)
    for rollout in range(rollouts):
        alphas = head(rollout)
        for pol in (fast, full):
            pol.on_new_weights()
        steps = shape if shape is not None else _random_rollout(random.Random(seed * 1000 + rollout))
        for at, (batch, steady) in enumerate(steps):
            stays = steps[at + 1][0] if at + 1 < len(steps) else 0
            ks = []
            for i, pol in enumerate((fast, full)):
                if pol is full:
                    pol._holds.clear()
                rng = rngs[i]
                k = pol.choose(batch, steady, lambda stays=stays: stays)
                settle = pol.settling if steady else -1
                if prev[i] > 0:   # this step verifies the drafts of the one before, as the engine does
                    verified = min(batch, drafted_by[i])
                    accepted = _accepted(rng, alphas, prev[i], verified)
                    pol.acceptance.observe([prev[i]] * verified, accepted)
                    pol.credit_verified(verified, [prev[i]] * verified, accepted)
                t = _tiny_default_step(batch, k) * math.exp(rng.gauss(0.0, 0.1)) * (3.0 if rng.random() < 0.02 else 1.0)
                if pol.timing_valid and settle >= 0:
                    pol.observe_settle(settle, batch, batch, t)
                elif pol.timing_valid and steady and k == prev[i]:
                    pol.cost.observe(batch * (1 + k), batch, k, t)
                prev[i], drafted_by[i] = k, batch
                ks.append(k)
            assert ks[0] == ks[1], (fast.steps, batch, ks)
    return fast, full


def _booked(pol: SpeculationPolicy) -> dict[str, Any]:
    """What a policy's choices leave behind: the time it booked (which gates every exploration), its histograms,
    the probe and challenge schedules, the explorations queued, the calibrations and the settling."""
    names = ("steps", "_spent", "_spent_at_probe", "chosen_sum", "chosen_count", "histogram", "model_histogram",
             "explored_steps", "_probe", "_interval", "_next_probe_at", "_next_challenge_at", "_challenge_gap",
             "_incumbent", "_cycled", "_queue", "settling", "_back", "seconds_saved", "settle_excess")
    return {n: getattr(pol, n) for n in names}


@pytest.mark.parametrize("shape", [ONE_WAVE, TWO_WAVES], ids=["one_wave", "two_waves"])
@pytest.mark.parametrize(("alphas", "held_share"), [([0.0, 0.0, 0.0], 0.3), ([0.45, 0.3, 0.2], 0.3),
                                                    ([0.75, 0.6, 0.5], 0.3), ([0.95, 0.95, 0.95], 0.0)])
def test_the_fast_path_chooses_and_books_every_step_as_the_full_choice_does(alphas, held_share, shape):
    """choose's fast path (the same batch, or a bucket where not drafting is settled, and nothing new; also at
    a step that takes prompt tokens, and in a bucket the batch comes back to) gives the k the full choice gives
    at every step of RL rollouts and leaves the same state behind, bit for bit: the time it books (which gates
    every exploration), the histograms, the probe and challenge schedules, the settling. Where the engine
    stops drafting it answers a good share of the steps (`held_share`); where it drafts, every step brings
    new acceptance and it never answers."""
    fast, full = _lockstep(alphas, seed=3, rollouts=40, shape=shape)
    assert _booked(fast) == _booked(full)
    assert full.held_steps == 0
    assert fast.held_steps >= held_share * fast.steps, (fast.held_steps, fast.steps)
    if not held_share:
        assert fast.held_steps <= 0.02 * fast.steps
    assert fast.stats()["held_steps"] == fast.held_steps


@pytest.mark.parametrize(("shape", "seed"), [(ONE_WAVE, 5), (TWO_WAVES, 5), (None, 5), (None, 6), (None, 7)],
                         ids=["one_wave", "two_waves", "random_5", "random_6", "random_7"])
def test_the_fast_path_follows_a_head_that_turns_good_and_bad_as_the_full_choice_does(shape, seed):
    """A head accepted at 0.95 for four rollouts, then at 0 for four, and so on: every bucket's choice moves
    back and forth, and a record the fast path kept from before a move (in a bucket the batch left, or across a
    step that takes prompt tokens) must never answer for the new acceptance."""
    fast, full = _lockstep(lambda r: [0.95] * 3 if r // 4 % 2 else [0.0] * 3, seed=seed, rollouts=40, shape=shape)
    assert _booked(fast) == _booked(full)
    assert fast.histogram[3] > 0.05 * fast.steps and fast.histogram[0] > 0.5 * fast.steps   # it moved both ways
    assert fast.held_steps > 0.1 * fast.steps


@pytest.mark.parametrize("seed", range(3))
def test_the_fast_path_keeps_to_the_full_choice_where_explorations_are_due_all_the_time(seed):
    """Probes due every other step with budget to spare, on random rollouts and a head that turns good and bad:
    explorations start, wait, are cut short by prompt steps and by the batch leaving, in every bucket, and the
    records the fast path keeps per bucket must still answer only where the full choice would say the same."""
    fast, full = _lockstep(lambda r: [0.95] * 3 if r // 3 % 2 else [0.3, 0.1, 0.0], seed=seed, rollouts=30,
                           shape=None, probe_every=2, probe_every_max=4, explore_budget=0.2, challenge_every=2)
    assert _booked(fast) == _booked(full)
    assert fast.explored_steps > 0.05 * fast.steps and fast.held_steps > 0.05 * fast.steps


def test_the_fast_path_gives_way_to_an_exploration_its_budget_allows():
    """A probe waiting for its budget is held at the full choice's answer until the budget allows it; then
    the full choice runs and the probe starts at the same step as without the fast path."""
    starts = {}
    for name in ("fast", "full"):
        pol = SpeculationPolicy(k_max=2, probe_every=4, probe_every_max=4, explore_budget=0.01)
        _timed_every_k(pol, 8, lambda k: 0.005 + 0.004 * (k > 0) + 0.001 * k)
        started = []
        for _ in range(3000):
            if name == "full":
                pol._holds.clear()
            explored = pol.explored_steps
            k = pol.choose(8)
            if pol.explored_steps > explored:
                started.append(pol.steps)
            if k:
                pol.acceptance.observe([k] * 8, [0] * 8)
        starts[name] = (started, pol.held_steps)
    assert starts["fast"][0] == starts["full"][0]
    assert len(starts["fast"][0]) >= 5                     # probes ran, each after a wait
    assert starts["fast"][1] >= 0.5 * 3000 and starts["full"][1] == 0


def test_the_adaptive_scheduler_refuses_to_shadow_a_name_vllms_scheduler_uses(monkeypatch):
    """The names the adaptive scheduler adds to vLLM's Scheduler are free there (it once kept its policy in
    `policy`, overwriting vLLM's SchedulingPolicy); one vLLM starts using fails the engine at start, named."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from vllm.v1.core.sched.scheduler import Scheduler

    from skyrl_mtp.speculation.scheduler_hook import OWN_ATTRIBUTES, check_own_names_free

    check_own_names_free(SimpleNamespace(policy="fcfs", running=[]))   # vLLM's names: nothing of ours among them
    for name in OWN_ATTRIBUTES:
        with pytest.raises(AdaptiveSpeculationError, match=f"attribute `{name}`"):
            check_own_names_free(SimpleNamespace(**{name: 0}))
    monkeypatch.setattr(Scheduler, "end_step", lambda self: None, raising=False)
    with pytest.raises(AdaptiveSpeculationError, match="method `end_step`"):
        check_own_names_free(SimpleNamespace())


def test_the_scheduler_counts_the_requests_a_step_leaves_short_of_their_length_cap():
    """What the policy is told stays: a request this step brings to max_tokens (one token, plus every draft it
    verifies, counted as accepted) or to the model's length ends with it; the others may run on."""
    from types import SimpleNamespace

    from skyrl_mtp.speculation.scheduler_hook import AdaptiveSpeculationScheduler

    def req(rid, out, cap, total=20):
        return SimpleNamespace(request_id=rid, num_output_tokens=out, max_tokens=cap, num_tokens=total)

    running = [req("a", 10, 32), req("b", 31, 32), req("c", 29, 32), req("d", 5, 32, total=63), req("e", 30, 32)]
    sched = SimpleNamespace(running=running, max_model_len=64, _staying_seen=None,
                            _scheduled=SimpleNamespace(scheduled_spec_decode_tokens={"c": [7, 7], "e": [7]}))
    # b: its last token; c: 29 + 1 + 2 drafts = 32; d: the model's length (63 + 1); e: 30 + 1 + 1 = 32
    assert AdaptiveSpeculationScheduler._staying(sched) == 1 and sched._staying_seen == 1
    running[1].max_tokens = 33
    running[4] = req("e", 29, 32)
    assert AdaptiveSpeculationScheduler._staying(sched) == 3
    sched.running = [SimpleNamespace(request_id="x")]
    with pytest.raises(AdaptiveSpeculationError, match="counts its tokens to its cap"):
        AdaptiveSpeculationScheduler._staying(sched)
