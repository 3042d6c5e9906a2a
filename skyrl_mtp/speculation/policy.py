"""Adaptive speculation: how many draft tokens to propose at each engine step, chosen from measurements.

Why this exists: MTP drafting pays only when accepted drafts save more target forwards than the draft
steps and the longer verify cost. Both sides move: the cost of a draft step relative to the target
forward grows with the batch (the verify forward grows with the tokens it checks), and acceptance moves
as the head is trained. A fixed k therefore loses at large batches and with an untrained head. Here k is
chosen per engine step to maximise expected tokens per second, from

- live per-position acceptance, measured from what the rejection sampler kept (conditional: position i
  counts only requests whose drafts 1..i-1 were all accepted), with decay so it follows the head as it
  improves, and its weight cut to a few steps' worth at each weight sync (the next head's drafts soon
  outweigh the last one's), and
- a cost model fitted online on the running engine: whole-step time as a linear function of the tokens
  verified and of the draft steps run, one fit per batch bucket once that bucket has been timed at every k
  (a bucket drafts only from then on: the fit over all batch sizes it is judged on before is an
  extrapolation), with the uncertainty of its predictions: a batch bucket leaves the k it runs at only when
  the other k wins by more than one standard error of their cost difference, so a few slow steps on a busy
  machine do not start drafting where it does not pay. Its costs per k are made non-decreasing by isotonic
  regression weighted by how sure it is of each, and a step timed far beyond its prediction (a stall)
  counts as a bounded slow step once its bucket has timed that k more than once.

Closed loop: the first engine steps cycle k over k_max..0 to calibrate, and the first decode-only step of each
new batch bucket, while drafting can still pay, starts a cycle over the ks that bucket has not timed (a rollout's
tail cuts such cycles short; the next one resumes with what is left). Afterwards a probe every `probe_every` steps (backing off while
probes change nothing) runs, in turn, a neighbour of the best k (one shallower, one deeper) or k = 0 for two
steps, so the next position's acceptance and the costs stay measured as the head and the batch change (a probe
from k = 0 waits, up to one more interval, for a batch where it costs less: a rollout's tail); and a k
that may beat the best one within the fit's standard error is timed again soon (a challenge), so doubt does
not hold the engine at a k the evidence has turned against. Every exploration starts on a decode-only step
(one the engine times) and ends when the batch leaves its bucket. At k = 0 the drafter does not run; its KV cache
then has holes at the positions of those steps, which may lower later acceptance but never changes the emitted
tokens (the target verifies every draft), and the measured acceptance sees that effect.

Two halves, on vLLM's own mechanism (dynamic speculative decoding: the engine is built with
`num_speculative_tokens_per_batch_size`, so the scheduler takes drafts of any length <= k_max without
padding, and `SchedulerOutput.num_spec_tokens_to_schedule` is the K the runner passes to the drafter):
- the engine core's scheduler chooses k (adaptive_scheduler.py), so the engine core knows when a step
  drafted nothing and does not fetch drafts from the worker;
- the worker (`install`, below) follows that k, skips the drafter and the rejection sampler when nothing
  is drafted, and reports what it ran. A step with no drafts to verify and none to propose runs as a
  no-spec step: the runner's speculative bookkeeping (spec-decode metadata, drafter attention metadata,
  the draft copy-out) costs ~3% of a small model's step at batch 1, so without this an engine that has
  stopped drafting would still be slower than one built without speculation. Attention-only models with
  synchronous scheduling only: vLLM keeps zero-draft rows speculative for recurrent (hybrid) backends,
  and async scheduling carries draft state from one step to the next.
Both check every vLLM name they rely on and raise `AdaptiveSpeculationError` naming what moved.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from skyrl_mtp.allowed import DEFAULT_EXPLORE_BUDGET, EXPLORE_BUDGET_ALLOWED, is_explore_budget

logger = logging.getLogger(__name__)

PROPOSE_PARAMS = ("scheduler_output", "sampled_token_ids")   # the leading ones: the hook reads these, passes the rest
# vLLM's dynamic speculative decoding hands the drafter each step's k (the runner, not the hook, calls it)
DRAFTER_PROPOSE_PARAMS = ("num_speculative_tokens", "common_attn_metadata")
SAMPLE_PARAMS = ("logits", "spec_decode_metadata")
STATE_FIELDS = ("spec_decode_metadata", "spec_decode_common_attn_metadata")
# EngineConfig.explore_budget, set in the engine process's environment (rollout/engine.py) for the engine
# core's scheduler, which vLLM builds from its own config alone (adaptive_scheduler.py)
EXPLORE_BUDGET_ENV = "SKYRL_MTP_EXPLORE_BUDGET"


class AdaptiveSpeculationError(RuntimeError):
    """The vLLM code the adaptive speculation hook relies on is missing or changed."""


# ------------------------------------------------------------------------------------- pure parts

def expected_tokens(alphas: list[float], k: int) -> float:
    """Expected tokens emitted per request per step with k drafts; alphas[i] = P(accept i+1 | 1..i accepted)."""
    total, run = 1.0, 1.0
    for i in range(k):
        run *= alphas[i]
        total += run
    return total


@dataclass
class AcceptanceEstimate:
    """Per-position conditional acceptance, exponentially forgetting old steps (decay per observed step)."""

    k_max: int
    decay: float = 0.97
    prior_rate: float = 0.5
    prior_weight: float = 1.0
    attempts: list[float] = field(default_factory=list)
    accepts: list[float] = field(default_factory=list)
    version: int = 0     # counts the observations that changed the estimate

    def __post_init__(self) -> None:
        self.attempts = [0.0] * self.k_max
        self.accepts = [0.0] * self.k_max

    def observe(self, num_drafts: list[int], num_accepted: list[int]) -> None:
        """One verify step: per request, drafts scheduled and drafts accepted (a prefix)."""
        if not any(num_drafts):
            return
        # per request: positions reached (all earlier drafts accepted) and accepted; position i was attempted
        # by the requests that reached more than i positions and accepted by those that accepted more than i
        reached = [0] * (self.k_max + 1)
        kept = [0] * (self.k_max + 1)
        # counted per distinct (drafts, accepted) pair: a verify step at a large batch repeats a few pairs
        for (d, a), n in Counter(zip(num_drafts, num_accepted)).items():
            d = min(int(d), self.k_max)
            a = max(0, min(int(a), d))
            reached[min(a + 1, d)] += n
            kept[a] += n
        att, acc = [0.0] * self.k_max, [0.0] * self.k_max
        more_reached = more_kept = 0
        for i in range(self.k_max - 1, -1, -1):
            more_reached += reached[i + 1]
            more_kept += kept[i + 1]
            att[i], acc[i] = float(more_reached), float(more_kept)
        self.version += 1
        for i in range(self.k_max):
            if att[i]:   # decay only positions that get new evidence: unprobed positions keep their estimate
                self.attempts[i] = self.attempts[i] * self.decay + att[i]
                self.accepts[i] = self.accepts[i] * self.decay + acc[i]

    def refresh(self, max_attempts: float) -> None:
        """New weights: keep each position's rate but let it weigh at most `max_attempts` attempts, so the
        new head's own drafts outweigh the old head's within a few steps (decay alone takes ~1 / (1 - decay)
        steps, a whole rollout at a small batch, to forget a head that stopped being accepted)."""
        changed = False
        for i in range(self.k_max):
            if self.attempts[i] > max_attempts:
                scale = max_attempts / self.attempts[i]
                self.attempts[i] *= scale
                self.accepts[i] *= scale
                changed = True
        if changed:   # a head that drafted little since the last sync keeps its estimate, and so its version
            self.version += 1

    def rates(self) -> list[float]:
        return [(self.accepts[i] + self.prior_rate * self.prior_weight) / (self.attempts[i] + self.prior_weight)
                if self.attempts[i] + self.prior_weight > 0 else self.prior_rate for i in range(self.k_max)]


STEP_SECONDS_FLOOR = 1e-6   # CostModel.step_seconds never predicts less (a fit can extrapolate below zero)
FOLD_EVERY = 64   # OnlineLinearFit folds its queued samples at least this often (a fit nobody reads stays small)


class OnlineLinearFit:
    """Exponentially weighted least squares y ~ w . x, solved on demand (small ridge for stability), with the
    uncertainty of its predictions: the residual variance (weighted residual sum of squares over the
    weight beyond the `dim` fitted parameters) times d' A^-1 d, A the weighted Gram matrix."""

    def __init__(self, dim: int, decay: float = 0.995, ridge: float = 1e-4, resolve_share: float = 0.1):
        self.dim, self.decay, self.ridge, self.resolve_share = dim, decay, ridge, resolve_share
        # plain Python lists: the engine core folds and solves this between model steps, where each numpy
        # call on these few numbers cost 10-20x what it costs in a quiet process (its code is cold there),
        # so a 6x6 fold and solve took ~0.3 ms with numpy and a fraction of that without
        self._xtx = [[0.0] * dim for _ in range(dim)]
        self._xty = [0.0] * dim
        self._pending: list[tuple[tuple[float, ...], float]] = []   # samples not yet in _xtx / _xty (_fold)
        self.yty = 0.0
        self.weight = 0.0      # decayed number of samples
        self.fresh = 0.0       # decayed number of samples added since the last solve
        self._solved: _Solution | None = None
        self._solve_count = 0

    def add(self, x: list[float], y: float) -> bool:
        """One sample; the engine adds one per step, so it only queues it for the Gram matrix (_fold). True when
        it ends the fit's current solve (the next read solves it again, with new predictions)."""
        self._pending.append((tuple(x), y))
        if len(self._pending) >= FOLD_EVERY:
            self._fold()
        self.yty = self.yty * self.decay + y * y
        self.weight = self.weight * self.decay + 1.0
        self.fresh = self.fresh * self.decay + 1.0
        if self.fresh > self.resolve_share * self.weight:
            # solved again once the samples added since carry `resolve_share` of the fit's weight: every
            # sample while the fit is young, every ~20 once it is steady (the engine adds one per step). A
            # solve and the tables read off it cost ~0.2 ms in the engine core; solving every ~10 (a share
            # of 0.05) chose no better in replays (speculation_policy.py)
            ended, self._solved = self._solved is not None, None
            return ended
        return False

    def _fold(self) -> None:
        """Adds the queued samples to the weighted Gram matrix (_xtx, _xty) in one pass, each decayed as if
        added one at a time."""
        pending = self._pending
        if not pending:
            return
        n, dim, decay = len(pending), self.dim, self.decay
        xtx, xty = self._xtx, self._xty
        scale = decay ** n
        for i in range(dim):
            row = xtx[i]
            for j in range(dim):
                row[j] *= scale
            xty[i] *= scale
        for age, (x, y) in enumerate(reversed(pending)):   # the newest sample first, weight decay^age
            w = decay ** age
            # a step's features are mostly zeros (no drafting: 4 of 6), which add nothing to any entry
            nz = [(i, v) for i, v in enumerate(x) if v]
            for i, xi in nz:
                wx = w * xi
                row = xtx[i]
                for j, xj in nz:
                    row[j] += wx * xj
                xty[i] += wx * y
        pending.clear()

    def _solution(self) -> _Solution:
        if self._solved is None:
            self._solved = self._solve()
            self._solve_count += 1
            self.fresh = 0.0
        return self._solved

    def solves(self) -> int:
        """How often the fit was solved, counting a pending solve: changes whenever its predictions do."""
        self._solution()
        return self._solve_count

    def _solve(self) -> _Solution:
        """Solved over the features some sample has used (the others get weight 0 and unknown variance);
        the ridge, relative to each diagonal entry, keeps that system positive definite."""
        self._fold()
        xtx, xty = self._xtx, self._xty
        seen = [xtx[i][i] > 0 for i in range(self.dim)]
        idx = [i for i in range(self.dim) if seen[i]]
        inverse = _spd_inverse([[xtx[i][j] + (self.ridge * xtx[i][i] if i == j else 0.0) for j in idx] for i in idx])
        w = [0.0] * self.dim
        for a, i in enumerate(idx):
            w[i] = sum(inverse[a][b] * xty[j] for b, j in enumerate(idx))
        variance = math.inf
        if self.weight > self.dim:
            quad = sum(w[i] * sum(xtx[i][j] * w[j] for j in idx) for i in idx)
            rss = self.yty - 2.0 * sum(w[i] * xty[i] for i in idx) + quad
            variance = max(rss, 0.0) / (self.weight - self.dim)
        position = [-1] * self.dim
        for a, i in enumerate(idx):
            position[i] = a
        return _Solution(w, inverse, seen, variance, position)

    def weights(self) -> list[float]:
        return self._solution().weights

    def predict(self, x: list[float]) -> float:
        return sum(w * v for w, v in zip(self._solution().weights, x))

    def residual_variance(self) -> float:
        """Weighted residual sum of squares over the weight left after fitting `dim` parameters; infinite
        until more samples than parameters were seen."""
        return self._solution().variance

    def difference_sd(self, x_a: list[float], x_b: list[float]) -> float:
        """Standard error of predict(x_a) - predict(x_b): large where the samples barely tell the two apart
        (few of them, or noisy), infinite along a direction no sample has explored."""
        d = [a - b for a, b in zip(x_a, x_b)]
        if not any(d):
            return 0.0
        sol = self._solution()
        if math.isinf(sol.variance) or any(di and not s for di, s in zip(d, sol.seen)):
            return math.inf
        nz = _nonzeros(d, sol.position)
        return math.sqrt(max(_quadratic(sol.inverse, nz, nz), 0.0) * sol.variance)

    def line_table(self, rows: LineRows) -> LineTable:
        """predict and difference_sd for the rows x_i(b) = p_i + b q_i, as functions of b, from the current
        solve (LineTable)."""
        return LineTable(self._solution(), rows)


class LineRows:
    """Rows x_i(b) = p_i + b q_i that a cost model asks each of its fits about: their pairwise differences
    and where each difference vanishes, computed once (they do not depend on any fit's solve)."""

    def __init__(self, ps: list[list[float]], qs: list[list[float]]):
        p, q = np.asarray(ps, dtype=np.float64), np.asarray(qs, dtype=np.float64)
        self.n = len(ps)
        self.p_rows, self.q_rows = p.tolist(), q.tolist()
        self.dp, self.dq = p[:, None, :] - p[None, :, :], q[:, None, :] - q[None, :, :]
        self.same = _zero_sets(self.dp, self.dq)
        dp, dq = self.dp.tolist(), self.dq.tolist()
        self.pair_diffs = [[(dp[i][j], dq[i][j]) for j in range(self.n)] for i in range(self.n)]
        self._explored: dict[tuple[bool, ...], tuple] = {}
        self._sparse: dict[tuple[int, ...], list] = {}

    def sparse_pairs(self, position: list[int]) -> list[tuple[int, int, list, list]]:
        """(i, j, dp, dq) for each pair i < j, its differences in _nonzeros' form for a solve whose features sit
        at `position` in its inverse: the same for every solve that has seen the same features."""
        key = tuple(position)
        got = self._sparse.get(key)
        if got is None:
            got = self._sparse[key] = [(i, j, _nonzeros(self.pair_diffs[i][j][0], position),
                                        _nonzeros(self.pair_diffs[i][j][1], position))
                                       for i in range(self.n) for j in range(i + 1, self.n)]
        return got

    def explored(self, seen: tuple[bool, ...]) -> tuple:
        """_zero_sets over the features a fit has not seen: where a difference leaves them all at zero."""
        got = self._explored.get(seen)
        if got is None:
            unseen = ~np.asarray(seen, dtype=bool)
            got = self._explored[seen] = _zero_sets(self.dp[..., unseen], self.dq[..., unseen])
        return got


class LineTable:
    """Predictions and their pairwise standard errors for rows x_i(b) = p_i + b q_i, from one solve of an
    OnlineLinearFit, evaluated at any b in a few float operations per pair.

    The cost model reads a step's cost at every k for each batch size a rollout's tail passes through (a
    new size every step or two), on the engine core's critical path. Each step's features are affine in the
    batch size, so w . x_i(b) = w . p_i + b w . q_i, and a difference's quadratic form d' A^-1 d, with
    d = dp + b dq, is dp'A^-1 dp + 2b dp'A^-1 dq + b^2 dq'A^-1 dq: the quadratic forms are computed once per solve,
    and `at(b)` gives exactly what predict / difference_sd give at x_i(b)."""

    def __init__(self, sol: _Solution, rows: LineRows):
        w = sol.weights
        n = self.n = rows.n
        self.variance = sol.variance
        self._a = [sum(wi * x for wi, x in zip(w, p)) for p in rows.p_rows]
        self._c = [sum(wi * x for wi, x in zip(w, q)) for q in rows.q_rows]
        # the quadratic forms of each pair's difference (above the diagonal: at() reads no other), in plain
        # Python over the differences' nonzero seen features, for the reason OnlineLinearFit gives
        pp, pq, qq = ([[0.0] * n for _ in range(n)] for _ in range(3))
        if any(sol.seen) and not math.isinf(sol.variance):
            inv = sol.inverse
            for i, j, u, v in rows.sparse_pairs(sol.position):
                pp[i][j], pq[i][j], qq[i][j] = _quadratic(inv, u, u), _quadratic(inv, u, v), _quadratic(inv, v, v)
        self._pairs = [list(zip(*cols)) for cols in zip(pp, pq, qq, *rows.same, *rows.explored(tuple(sol.seen)))]

    def prediction(self, i: int, b: float) -> float:
        """predict(x_i(b)) alone (the same floating-point operations as at(b))."""
        return self._a[i] + b * self._c[i]

    def at(self, b: float) -> tuple[list[float], list[list[float]]]:
        """predict(x_i(b)) for each row, and difference_sd(x_i(b), x_j(b)) for every pair."""
        preds = [a + b * c for a, c in zip(self._a, self._c)]
        var, inf = self.variance, math.inf
        sds = [[0.0] * self.n for _ in range(self.n)]
        for i in range(self.n):
            row = self._pairs[i]
            for j in range(i + 1, self.n):
                pp, pq, qq, same, same_at, explored, explored_at = row[j]
                if same or same_at == b:
                    sd = 0.0
                elif math.isinf(var) or not (explored or explored_at == b):
                    sd = inf
                else:
                    sd = math.sqrt(max(pp + 2.0 * b * pq + b * b * qq, 0.0) * var)
                sds[i][j] = sds[j][i] = sd
        return preds, sds


def _nonzeros(d: list[float], position: list[int]) -> list[tuple[int, float]]:
    """(index into the solve's inverse, value) for each nonzero entry of d on a feature the solve has seen."""
    return [(position[f], v) for f, v in enumerate(d) if v and position[f] >= 0]


def _quadratic(inverse: list[list[float]], u: list[tuple[int, float]], v: list[tuple[int, float]]) -> float:
    """u' A^-1 v for sparse u, v (_nonzeros). (Loops, not nested sum()s over generators: a solve computes 30 of
    these, and the generators' overhead was most of their cost.)"""
    total = 0.0
    for a, a_v in u:
        row, inner = inverse[a], 0.0
        for b, b_v in v:
            inner += row[b] * b_v
        total += a_v * inner
    return total


def _spd_inverse(a: list[list[float]]) -> list[list[float]]:
    """The inverse of a small symmetric positive definite matrix (Gauss-Jordan in place: each pivot's column
    is replaced by the inverse's, so no identity block is carried along; no pivoting is needed)."""
    n = len(a)
    m = [row[:] for row in a]
    for c in range(n):
        pivot = m[c]
        inv_p = 1.0 / pivot[c]
        pivot[c] = 1.0
        for j in range(n):
            pivot[j] *= inv_p
        for r in range(n):
            if r != c:
                row = m[r]
                f = row[c]
                if f:
                    row[c] = 0.0
                    for j in range(n):
                        row[j] -= f * pivot[j]
    return m


def _zero_sets(dp: Any, dq: Any) -> tuple[list[list[bool]], list[list[float]]]:
    """For each pair (i, j), where the vector dp[i, j] + b dq[i, j] is zero: always (first list True), or at
    one b only (second list: that b), or nowhere (False, NaN)."""
    n = dp.shape[0]
    if not dp.shape[-1]:
        return [[True] * n for _ in range(n)], [[math.nan] * n for _ in range(n)]
    moves = dq.any(-1)
    always = ~moves & ~dp.any(-1)
    m = np.argmax(dq != 0, axis=-1)[..., None]
    lead_q = np.take_along_axis(dq, m, -1)[..., 0]
    b0 = -np.take_along_axis(dp, m, -1)[..., 0] / np.where(moves, lead_q, 1.0)
    hit = moves & ~(dp + b0[..., None] * dq).any(-1)
    return always.tolist(), np.where(hit, b0, np.nan).tolist()


@dataclass
class _Solution:
    weights: list[float]
    inverse: list[list[float]]   # A^-1 over the seen features
    seen: list[bool]
    variance: float
    position: list[int]          # per feature: its row in `inverse`, -1 where unseen


def bucket(batch: int) -> int:
    """Batch-size bucket of the cost tables: 1, 2-3, 4-7, 8-15, ... (powers of two)."""
    return max(int(batch), 1).bit_length()


def step_features(num_tokens: int, batch: int, k: int) -> list[float]:
    """One engine step, timed whole in the engine core: verify `num_tokens` (fixed cost + per token), then,
    when k > 0, the drafter's first pass (fixed + per request) and k - 1 single-token steps (fixed + per
    request). At k = 0 the drafter does not run and no drafts are fetched from the worker."""
    drafts, extra = float(k > 0), float(max(k - 1, 0))
    return [1.0, float(num_tokens), drafts, drafts * batch, extra, extra * batch]


@dataclass
class CostModel:
    """Step time fitted on the running engine's own timings: one fit per batch bucket (used once the bucket
    has been timed at every k, so no prediction extrapolates the batch more than 2x) and one over all
    steps (used before that)."""

    k_max: int
    global_fit: OnlineLinearFit = field(default_factory=lambda: OnlineLinearFit(6))
    buckets: dict[int, OnlineLinearFit] = field(default_factory=dict)
    seen_k: dict[int, set[int]] = field(default_factory=dict)
    stall_ratio: float = 1.5
    stall_min_samples: float = 1.5
    weight_at_k: dict[int, list[float]] = field(default_factory=dict)   # per bucket: its fit's decayed samples per k
    # per fit (the one over all batches and each bucket's): what its latest solve predicts (_reading)
    _readings: dict[OnlineLinearFit, _FitReading] = field(default_factory=dict, repr=False)
    _rows: LineRows | None = field(default=None, repr=False)
    # counts the timings that may change a prediction not yet read: a k timed for the first time in its bucket,
    # or a fit's solve given up for a new one (OnlineLinearFit.add)
    version: int = 0

    def observe(self, num_tokens: int, batch: int, k: int, seconds: float) -> None:
        """A steady step: it verified drafts proposed at the same k it now drafts (the previous step's k
        equals this one's), so its time is what a run at k costs per step, rejection sampling included. Once
        the bucket has a fit of its own, a time beyond `stall_ratio` x its prediction counts as that much:
        timings are skewed (a step is never faster than its work, often slower while the machine does
        something else), and with a few samples per k one stall would move that k's cost for a long time.
        Only the slow side is clipped, so a prediction that came out too high is corrected at once. And only at
        a k the bucket's fit has timed `stall_min_samples` times (decayed as the fit decays them): the cycle
        that completes a bucket times some k once, at one batch size, and the fit's prediction of that k at
        other sizes in the bucket can be a fraction of its cost (seen: 11 ms for a 36 ms step); clipped to
        1.5x that, the next timings would keep drafting looking cheap there for many steps."""
        x = step_features(num_tokens, batch, k)
        b = bucket(batch)
        fit = self.buckets.get(b)
        if fit is None:   # (built only when missing: this runs on every timed engine step)
            fit = self.buckets[b] = OnlineLinearFit(6)
            self.weight_at_k[b] = [0.0] * (self.k_max + 1)
            self.seen_k[b] = set()
        timed, seen = self.weight_at_k[b], self.seen_k[b]
        if len(seen) == self.k_max + 1 and timed[k] >= self.stall_min_samples:   # a stall is not what the step costs
            seconds = min(seconds, self.stall_ratio * max(fit.predict(x), 1e-6))
        ended = self.global_fit.add(x, seconds), fit.add(x, seconds)
        decay = fit.decay
        for j in range(len(timed)):
            timed[j] *= decay
        timed[k] += 1.0
        if k not in seen or any(ended):
            self.version += 1
        seen.add(k)

    def covers(self, batch: int) -> bool:
        return len(self.seen_k.get(bucket(batch), ())) == self.k_max + 1

    def covered_buckets(self) -> list[int]:
        return sorted(b for b, ks in self.seen_k.items() if len(ks) == self.k_max + 1)

    def _fit(self, batch: int) -> OnlineLinearFit:
        return self.buckets[bucket(batch)] if self.covers(batch) else self.global_fit

    def state(self, batch: int) -> tuple[OnlineLinearFit, int]:
        """Identifies the predictions for this batch: the same state, the same step_seconds / difference_sd."""
        fit = self._fit(batch)
        return fit, fit.solves()

    def table(self, batch: int) -> _CostTable:
        """Every prediction the policy reads for this batch size, read off the fit's LineTable (built once per
        solve) and kept until the fit is solved again: the policy asks every step (with the acceptance moving
        each drafting step), and a rollout's draining tail meets a new batch size every step or two."""
        return self.table_in_state(self.state(batch), batch)

    def table_in_state(self, state: tuple[OnlineLinearFit, int], batch: int) -> _CostTable:
        """table(batch), given the batch's state() (a caller that holds it saves looking the fit up again)."""
        reading = self._reading(*state)
        table = reading.tables.get(batch)
        if table is None:
            table = reading.tables[batch] = self._compute_table(reading.lines, batch)
        return table

    def _reading(self, fit: OnlineLinearFit, solves: int) -> _FitReading:
        """The fit's LineTable and the tables read off it so far, kept until the fit is solved again (`solves`
        is its current solve count: state()). One per fit: a rollout's tail reads every bucket's fit in turn,
        and each keeps what it predicts until its own next solve."""
        reading = self._readings.get(fit)
        if reading is None or reading.solves != solves:
            if self._rows is None:   # each k's step features at batch b are p_k + b q_k, and a zero row
                ks = range(self.k_max + 1)
                ps = [step_features(0, 0, k) for k in ks]
                qs = [[f1 - f0 for f1, f0 in zip(step_features(1 + k, 1, k), p)] for k, p in zip(ks, ps)]
                self._rows = LineRows(ps + [[0.0] * fit.dim], qs + [[0.0] * fit.dim])
            reading = self._readings[fit] = _FitReading(solves, fit.line_table(self._rows), {})
        return reading

    def _compute_table(self, lines: LineTable, batch: int) -> _CostTable:
        ks = range(self.k_max + 1)
        # the last row, all zeros: difference_sd against it is the prediction's own standard error
        preds, sds = lines.at(float(batch))
        seconds = [max(preds[k], STEP_SECONDS_FLOOR) for k in ks]
        step_sd = [sds[k][-1] for k in ks]
        weights = ([1.0] * len(seconds) if any(math.isinf(v) or v <= 0 for v in step_sd)
                   else [1.0 / (v * v) for v in step_sd])
        return _CostTable(seconds, step_sd, isotonic(seconds, weights), [row[:-1] for row in sds[:-1]])

    def step_seconds(self, batch: int, k: int) -> float:
        """Steady-state decode step with k drafts per request: verify b*(1+k) tokens, then draft k."""
        return self.table(batch).seconds[k]

    def line_seconds(self, batch: int, k: int) -> float:
        """The fit's prediction for k at this batch, read off its line without building the batch's table:
        step_seconds(batch, k) wherever that prediction is above step_seconds' floor (1e-6 s)."""
        return self.lines(batch).prediction(k, float(batch))

    def lines(self, batch: int) -> LineTable:
        """The LineTable line_seconds reads for this batch (the same until the batch's fit is solved again)."""
        return self.lines_in_state(self.state(batch))

    def lines_in_state(self, state: tuple[OnlineLinearFit, int]) -> LineTable:
        """lines(batch), given the batch's state(): the fit's predictions per k (and a zero row) as functions
        of the batch size, for its current solve."""
        return self._reading(*state).lines

    def predict(self, num_tokens: int, batch: int, k: int) -> float:
        """The fit's time for one step of these features (the bucket's fit once it is timed at every k)."""
        return self._fit(batch).predict(step_features(num_tokens, batch, k))

    def step_sd(self, batch: int, k: int) -> float:
        """Standard error of step_seconds(batch, k)."""
        return self.table(batch).sd[k]

    def monotone_step_seconds(self, batch: int) -> list[float]:
        """step_seconds for k = 0..k_max made non-decreasing in k (a step with more drafts does strictly
        more work) by weighted isotonic regression: where the fit calls a deeper step cheaper, the
        predictions involved are pooled, each weighted by how sure the fit is of it (1 / its variance). So
        a k timed rarely and slowly once (k = 0 while the engine drafts) does not make every deeper step
        look as dear as it, and free to draft; nor does a fast outlier make drafting look free."""
        return list(self.table(batch).monotone)

    def difference_sd(self, batch: int, k: int, j: int) -> float:
        """Standard error of step_seconds(batch, k) - step_seconds(batch, j), from the same fit."""
        return self.table(batch).difference_sd[k][j]

    def draft_seconds_floor(self, batch: int, k: int) -> float:
        """What k drafts per request add to a step at least, known from timings: their extra time over k = 0
        at the smallest batch of the largest bucket below this one that was timed at every k (drafting for
        more requests costs no less); 0 when there is none."""
        return self.draft_seconds_floors(batch)[k]

    def draft_seconds_floors(self, batch: int) -> list[float]:
        """draft_seconds_floor for every k (0..k_max), reading the reference batch's predictions once."""
        below = [b for b in self.covered_buckets() if b < bucket(batch)]
        if not below:
            return [0.0] * (self.k_max + 1)
        seconds = self.table(1 << (below[-1] - 1)).seconds
        return [max(s - seconds[0], 0.0) for s in seconds]


@dataclass(frozen=True)
class _Hold:
    """A full choice of k = 0 by SpeculationPolicy.choose and what it rested on (SpeculationPolicy._held)."""

    batch: int
    rival: int
    seconds: float          # k = 0's predicted step time (_model_choice's)
    cost: CostModel
    fit: OnlineLinearFit    # the fit the choice read, and its solve at the time
    solution: _Solution | None
    acceptance: AcceptanceEstimate
    acceptance_version: int
    settle_version: int
    gate: int               # _exploration_gate at that step
    regret: float           # where an exploration was due: the regret that kept it waiting (inf: a smaller batch)
    settled_top: int        # where k = 0 is settled across the bucket (_model_choice): its largest batch, else 0
    lines: LineTable | None   # and then the fit's lines, which give each batch size's step time
    # a bucket not timed at every k (None: one that is): the cost model's version, and what its calibration
    # check found (_calibration_regret; inf and True where it did not run: the bucket had its cycle, which only
    # a full choice there changes) and whether that holds at every batch size of the bucket
    cost_version: int | None = None
    calibration: float = math.inf
    calibration_anywhere: bool = True


@dataclass(frozen=True)
class _FitReading:
    """What one solve of a fit predicts (CostModel._reading): its LineTable, and the tables at the batch sizes
    read so far."""

    solves: int
    lines: LineTable
    tables: dict[int, _CostTable]


@dataclass(frozen=True)
class _CostTable:
    """A CostModel's predictions at one batch size, per k (CostModel.table)."""

    seconds: list[float]               # step_seconds
    sd: list[float]                    # step_sd
    monotone: list[float]              # monotone_step_seconds
    difference_sd: list[list[float]]   # [k][j]: difference_sd(batch, k, j)


def isotonic(values: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in weighted least squares (pool adjacent
    violators)."""
    blocks: list[list[float]] = []      # [weighted mean, weight, length]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [m for m, _, n in blocks for _ in range(int(n))]


def best_k(alphas: list[float], cost: CostModel, batch: int, k_max: int,
           incumbent: int = 0) -> tuple[int, list[float]]:
    """The k with the most expected tokens per second per request (ties -> smaller k), and the predicted
    rates per k.

    A step with more drafts does strictly more work, so the predicted cost is made non-decreasing in k
    (CostModel.monotone_step_seconds): a fit from noisy timings (a loaded machine) can otherwise predict a
    deeper step to be cheaper and pick k where the drafts buy nothing. And a k other than the `incumbent` (the
    k chosen last at this batch; k = 0, no drafting, before any) must win after its cost is raised by one
    standard error of how much it costs more than the incumbent (a shallower k: at most the incumbent's cost).
    A fit resting on a few timed steps, one of them slow, or one that extrapolates to a batch it has not
    timed, is not enough evidence to switch. As timings of both settings accumulate the margin shrinks, so a
    real gain is still taken."""
    return best_k_in_table(alphas, cost.table(batch), k_max, incumbent)


def best_k_in_table(alphas: list[float], table: _CostTable, k_max: int, incumbent: int = 0) -> tuple[int, list[float]]:
    """best_k at the batch size `table` holds the predictions of (CostModel.table)."""
    costs, doubts = table.monotone, table.difference_sd
    tokens = [expected_tokens(alphas, k) for k in range(k_max + 1)]
    rates = [tokens[k] / costs[k] for k in range(k_max + 1)]
    judged = []
    for k in range(k_max + 1):
        doubt = doubts[k][incumbent] if k != incumbent else 0.0
        # a shallower k does less work than the incumbent: it never costs more, however unsure the fit
        dear = costs[k] + doubt if k > incumbent else min(costs[k] + doubt, costs[incumbent])
        judged.append(tokens[k] / dear)
    best = max(range(k_max + 1), key=lambda k: (judged[k], -k))
    return best, rates


def plausible_rival(alphas: list[float], cost: CostModel, batch: int, k_max: int, best: int,
                    rates: list[float]) -> int:
    """A k that may beat `best` by more than the fit can rule out: its tokens per second with its cost one
    standard error (of its difference to best) in its favour exceed best's. The one with the highest such
    rate, or -1 when there is none."""
    return plausible_rival_in_table(alphas, cost.table(batch), k_max, best, rates)


def plausible_rival_in_table(alphas: list[float], table: _CostTable, k_max: int, best: int,
                             rates: list[float]) -> int:
    """plausible_rival at the batch size `table` holds the predictions of (CostModel.table)."""
    top, rival = rates[best], -1
    doubts = table.difference_sd
    for k in range(k_max + 1):
        if k == best:
            continue
        sd = doubts[k][best]
        if math.isinf(sd):
            continue
        e = expected_tokens(alphas, k)
        c = max(e / rates[k] - sd, 1e-9)     # rates[k] = e / (k's monotone cost)
        r = e / c
        if r > top:
            top, rival = r, k
    return rival


def settled_across(alphas: list[float], cost: CostModel, lo: int, hi: int, k_max: int, best: int) -> bool:
    """True when, at every batch size in [lo, hi] (one fit's bucket), best_k with `best` as the incumbent
    keeps `best` and plausible_rival finds no rival to it; checked at lo and hi only.

    Between the ends each k's cost is linear in the batch (the fit's line) and the standard error of a
    difference is the norm of an affine function of it, so convex. Where at both ends the costs rise with k
    (isotonic regression changes nothing) and stay above step_seconds' floor, and for every k != best
    tokens[best] * (cost[k] - sd) - tokens[k] * cost[best] > 0 (k is no rival, even with its cost one
    standard error lower; this also keeps best_k at best, as deeper ks carry more tokens), that difference is
    concave in the batch, so positive everywhere between. An infinite standard error at either end, or
    expected tokens that do not rise with k, are left to the per-batch computation (False)."""
    tokens = [expected_tokens(alphas, k) for k in range(k_max + 1)]
    if any(deeper <= shallower for shallower, deeper in zip(tokens, tokens[1:])):
        return False
    for batch in dict.fromkeys((lo, hi)):
        table = cost.table(batch)
        costs = table.seconds
        if table.monotone != costs or min(costs) <= STEP_SECONDS_FLOOR:
            return False
        for k in range(k_max + 1):
            if k == best:
                continue
            sd = table.difference_sd[k][best]
            if math.isinf(sd) or tokens[best] * (costs[k] - sd) - tokens[k] * costs[best] <= 0.0:
                return False
    return True


def regret_seconds(alphas: list[float], cost: CostModel, batch: int, k: int, best: int) -> float:
    """What one step at k instead of `best` costs in engine time: its predicted time minus the time the best
    k needs for the tokens it is expected to emit (never negative). A shallower step is cheaper but emits
    fewer tokens, so exploring it is not free; a deeper step whose drafts are accepted pays for itself."""
    return regret_from_costs(alphas, {j: cost.step_seconds(batch, j) for j in (k, best)}, k, best)


def step_savings(costs: Mapping[int, float] | list[float], k: int, accepted_per_request: float) -> float:
    """Engine seconds one step with k drafts per request saved against not drafting, at step costs per k
    (costs[k]): its requests emitted 1 + accepted_per_request tokens each, which plain steps emit at one per
    costs[0]; negative when the drafts cost more than they brought."""
    return accepted_per_request * costs[0] - (costs[k] - costs[0])


def regret_from_costs(alphas: list[float], costs: Mapping[int, float] | list[float], k: int, best: int) -> float:
    """regret_seconds with the step time per k given (costs[k], costs[best])."""
    per_token = costs[best] / expected_tokens(alphas, best)
    return max(costs[k] - per_token * expected_tokens(alphas, k), 0.0)


@dataclass
class SpeculationPolicy:
    """Chooses k per engine step (closed loop over AcceptanceEstimate and CostModel).

    Calibration: the first steps cycle k over k_max..0, two steps each (`warmup_cycles` times). Later, when
    a batch bucket not yet timed at every k is met (the warm-up's steps may fall in smaller buckets while
    a rollout's requests are still arriving), a cycle over the ks it has not timed (`_calibration`) runs
    there if drafting may pay (the live
    acceptance can gain `min_gain` tokens per step and the model fitted so far, one standard error in
    drafting's favour, puts the best k > 0 within `calibrate_within` of k = 0 in tokens per second; an
    untrained head, or drafts that cost several plain steps: nothing to calibrate for; the probes keep
    watching) and the cycle fits the exploration budget (below). Until it has been timed at every k a
    bucket runs k = 0: its costs would be read off the fit over all batch sizes, an extrapolation.

    Choice: best_k, which switches a bucket away from the k it chose last (k = 0 at first) only on evidence
    beyond one standard error of the cost fit. Challenges: a k that could beat that choice within the
    standard error (plausible_rival) runs two steps, `challenge_every` steps after the choice moved and then
    at doubling gaps while it stays, within the exploration budget, until the evidence settles it. The
    choice moves when a bucket's choice changes, not when the batch passes into a bucket with a choice of
    its own (a rollout's tail does that every rollout).

    New weights (`on_new_weights`): the acceptance evidence is cut to `refresh_attempts` drafts per position.

    Held steps (`_held`): most of an engine's plain steps repeat the batch of the last full choice in their
    bucket, or stay in a bucket where not drafting is settled, with nothing new timed into the fit's solve, no
    new acceptance and no exploration allowed to start; they get that choice's k and its bookkeeping without
    the full choice (`held_steps` counts them). So do the prompt steps among them (no exploration starts
    there), and the steps of a bucket the batch comes back to (each bucket keeps its own record).

    Savings (`credit_verified`): every verified step adds what its accepted drafts saved in engine time, by
    the fitted costs (the plain steps those tokens would have taken, less what drafting and verifying
    added), to `seconds_saved`: the trainer weighs it against what training the head costs.

    Probes: at most one per `probe_every` steps (doubling up to `probe_every_max` while they change nothing).
    A probe from k = 0 that costs `probe_cheaper_by` times more at this batch than at the smallest batch the
    engine has timed at every k waits for a step at a batch where it costs less (a rollout's tail), for at
    most one more interval (_cheaper_at_a_smaller_batch): it learns the same acceptance there, for less.
    Probes and bucket calibrations share one budget: each runs only when its predicted regret (regret_seconds:
    the engine time its steps take beyond what the best k needs for the same expected tokens) is within
    `explore_budget` of the engine time predicted since the last one (`trainer.mtp.explore_budget`; at 0 only
    explorations predicted to cost nothing run). So exploring stays a small share of the time both where a
    draft step costs many plain steps and where a shallower step gives up accepted drafts.

    Settling: the plain steps right after an exploration has returned to k = 0 run slower than plain steps
    do (seen on the CPU runner: the three after the step that verifies the last drafts took 7.2 / 6.5 / 5.9
    ms against 5.6). No k is timed there, so no fit sees it: those `settle_steps` steps are kept out of
    k = 0's fit, their time beyond its prediction is averaged per position (`observe_settle`), and that
    excess (`settle_seconds`) is charged to every exploration that leaves k = 0, with its predicted regret.
    So `explore_budget` bounds what exploring costs, not only what its own steps cost.

    Steady steps only: a probe, challenge or bucket calibration starts on a step that schedules decode tokens
    only (`choose(batch, steady=True)`), the one kind of step the engine times, and its queued steps are
    dropped once the batch leaves the bucket it was chosen for or a step takes prompt tokens. A rollout's
    first steps (requests arriving, one to hundreds in a few steps) would otherwise start excursions that
    are never timed, so the doubt behind them never settles and they recur at every rollout, and whose
    second step runs at a batch many times the one their regret was charged at. Nor does one start where the
    engine knows the step ends so many requests (at their length cap) that the next step runs in a smaller
    bucket (`choose`'s `staying`, _lasting)."""

    k_max: int
    max_batch: int | None = None   # the engine's most requests per step (max_num_seqs), where known
    warmup_cycles: int = 3
    probe_every: int = 32
    probe_every_max: int = 512
    min_gain: float = 0.1
    calibrate_within: float = 0.25
    explore_budget: float = DEFAULT_EXPLORE_BUDGET
    challenge_every: int = 4
    refresh_attempts: float = 16.0
    acceptance: AcceptanceEstimate = None  # type: ignore[assignment]
    cost: CostModel = None  # type: ignore[assignment]
    steps: int = 0
    _probe: int = 0
    chosen_sum: float = 0.0
    chosen_count: int = 0
    histogram: list[int] = field(default_factory=list)        # steps per k run
    # steps per k the model chose, exploration aside: a probe, challenge or timing-cycle step counts at the
    # bucket's incumbent k, and not at all before the model has chosen at that batch size (the warm-up)
    model_histogram: list[int] = field(default_factory=list)
    explored_steps: int = 0        # steps run for exploration: warm-up, calibration cycles, probes, challenges
    _queue: list[int] = field(default_factory=list)
    _queue_bucket: int = 0         # the bucket an exploration's queued steps are for (0: the warm-up, any batch)
    _queue_calibrates: bool = False   # the queued steps are a bucket's calibration cycle
    _cycled: set[int] = field(default_factory=set)           # buckets given a calibration cycle after warm-up
    _incumbent: dict[int, int] = field(default_factory=dict)  # per bucket: the k the model chose last
    _interval: int = 0
    _next_probe_at: int = 0
    _spent: float = 0.0            # predicted engine seconds of the steps chosen by the model
    _spent_at_probe: float = 0.0
    _memo: tuple[tuple, tuple[int, int, float]] | None = None   # _model_choice's inputs -> (best, rival, its step time)
    # _model_choice's inputs but the batch -> whether no batch size of that bucket up to the engine's max_batch
    # drafts or has a rival (settled_across; where not, each size is computed), and that top
    _settled: tuple[tuple, bool, int] | None = None
    _next_challenge_at: int = 0
    _challenge_gap: int = 0
    seconds_saved: float = 0.0     # engine seconds the verified drafts saved (credit_verified; may be < 0)
    settle_steps: int = 3
    settle_decay: float = 0.9
    # the step just chosen is the i-th plain step (0-based) after the one that verified an exploration's last
    # drafts on the way back to the model's k = 0; -1 when it is not one of the first `settle_steps`
    settling: int = -1
    settle_excess: list[float] = field(default_factory=list)   # per position: decayed mean of time beyond k = 0's fit
    settle_weight: list[float] = field(default_factory=list)   # per position: decayed count of those timings
    _back: int = -1                # steps at k = 0 since the last step that drafted (capped at settle_steps + 2)
    _settle_version: int = 0       # counts observe_settle's updates (settle_seconds changed)
    _regret_memo: tuple[tuple, float] | None = None   # _two_steps_affordable's inputs -> the excursion's regret
    # per bucket: what the last full choice there rested on, for choose's fast path (_held); and the one the
    # latest full choice recorded (None when it recorded none), the only one an exploration due may be held at
    _holds: dict[int, _Hold] = field(default_factory=dict)
    _hold: _Hold | None = None
    # a probe from k = 0 waits for a batch where it costs this many times less (_cheaper_at_a_smaller_batch);
    # math.inf: it never waits
    probe_cheaper_by: float = 2.0
    _probe_deferred: bool = False  # the last due probe was affordable but waits for a smaller batch
    _small_regret_memo: tuple[tuple, float] | None = None   # _cheaper_at_a_smaller_batch's inputs -> the regret there
    held_steps: int = 0            # steps answered by that fast path

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max={self.k_max}: adaptive speculation needs a maximum of at least 1")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"max_batch={self.max_batch}: an engine runs at least one request per step")
        if not 0.0 <= self.explore_budget <= 1.0:
            raise ValueError(f"explore_budget={self.explore_budget}: a share of engine time in [0, 1]")
        if not self.probe_cheaper_by >= 1.0:
            raise ValueError(f"probe_cheaper_by={self.probe_cheaper_by}: a probe waits only for a cheaper batch (>= 1)")
        if self.acceptance is None:
            self.acceptance = AcceptanceEstimate(self.k_max)
        if self.cost is None:
            self.cost = CostModel(self.k_max)
        if self.settle_steps < 0 or not 0.0 < self.settle_decay < 1.0:
            raise ValueError(f"settle_steps={self.settle_steps}, settle_decay={self.settle_decay}: need "
                             "settle_steps >= 0 and 0 < settle_decay < 1")
        self.histogram = [0] * (self.k_max + 1)
        self.model_histogram = [0] * (self.k_max + 1)
        self.settle_excess = [0.0] * self.settle_steps
        self.settle_weight = [0.0] * self.settle_steps
        self._back = self.settle_steps + 2   # nothing drafted yet: nothing to settle from

    @property
    def timing_valid(self) -> bool:
        """False during the first calibration cycle: the first step at each depth pays one-off costs
        (kernel selection, buffer allocation) that would bias the cost fit for a long time."""
        return self.steps > 2 * (self.k_max + 1)   # len(self._cycle()): each k twice

    @property
    def warmup_steps(self) -> int:
        """How many first steps the calibration cycles take: an engine pays them once, at its start."""
        return len(self._cycle()) * self.warmup_cycles

    def _cycle(self) -> list[int]:
        """k_max, k_max, ..., 0, 0: each k twice, so the second step at k is a steady one (timed)."""
        return [k for k in range(self.k_max, -1, -1) for _ in range(2)]

    def _calibration(self, batch: int) -> list[int]:
        """A bucket's calibration cycle: each k it has not timed yet, twice, nearest the k it runs at first
        (the shallower on a tie). A rollout's tail passes through a bucket in a few steps, so its cycles are
        cut short; each one that times a single k leaves less for the next, where a cycle from k_max down
        would start over at the dearest k every time and never reach k = 0."""
        b = bucket(batch)
        incumbent = self._incumbent.get(b, 0)
        seen = self.cost.seen_k.get(b, set())
        todo = sorted((k for k in range(self.k_max + 1) if k not in seen), key=lambda k: (abs(k - incumbent), k))
        return [k for k in todo for _ in range(2)]

    def choose(self, batch: int, steady: bool = True, staying: Callable[[], int] | None = None) -> int:
        """k for an engine step of `batch` requests; `steady`: the step schedules decode tokens only (no
        prompt tokens), so it can be timed and an exploration may start or go on there. `staying`, asked only
        where an exploration would start: how many of the step's requests may still run at the next step
        (those it does not bring to their length cap); None: all of them (_lasting)."""
        b = bucket(batch)
        hold = self._holds.get(b)
        if hold is not None and self._held(hold, batch, steady):
            return 0
        self._hold = None
        self.steps += 1
        if self.steps == 1:
            self._queue, self._queue_bucket = self._cycle() * self.warmup_cycles, 0
        if self._queue and self._queue_bucket and (b != self._queue_bucket or not steady):
            if self._queue_calibrates:   # a calibration cut short may run again later, within the budget
                self._cycled.discard(self._queue_bucket)
            self._queue = []
        calibration = (math.inf, True)
        if steady and not self._queue and b not in self._cycled and not self.cost.covers(batch):
            calibration = self._calibration_regret(batch)
        if (calibration[0] <= self.explore_budget * (self._spent - self._spent_at_probe)
                and self._lasting(batch, staying)):
            self._cycled.add(b)
            self._queue, self._queue_bucket, self._queue_calibrates = self._calibration(batch), b, True
            self._spent_at_probe = self._spent
        queued = bool(self._queue)
        if queued:
            k = self._queue.pop(0)
            chosen = self._incumbent.get(b, -1)   # -1: the model has not chosen at this batch size yet
        else:
            k = chosen = self._model_choice(max(batch, 1))
            moved = self._incumbent.get(b) != k    # per bucket: a rollout's tail passing through is no move
            self._incumbent[b] = k
            if moved or not self._interval:   # the choice moved: watch closely again
                self._interval = self.probe_every
                self._challenge_gap = self.challenge_every
                self._next_probe_at = min(self._next_probe_at or self.steps + self._interval,
                                          self.steps + self._interval)
            _, rival, seconds = self._memo[1]   # type: ignore[index]
            self._spent += seconds
            gate = self._exploration_gate(rival, self.steps) if steady else 0
            if gate == 1:
                k = self._challenge(k, rival, max(batch, 1), staying)
            elif gate == 2:   # another k (never the best)
                k = self._probe_step(k, max(batch, 1), staying)
        self.chosen_sum += k
        self.chosen_count += 1
        self.histogram[k] += 1
        if chosen >= 0:
            self.model_histogram[chosen] += 1
        self.explored_steps += int(queued or k != chosen)
        self._track_settling(k, queued or k != chosen)
        # only at k = 0: the step after one that drafts verifies its drafts, new acceptance that ends any hold
        if not queued and k == chosen == 0 and steady and self._interval:
            self._hold = self._holds[b] = self._hold_after(batch, calibration)
        else:
            self._holds.pop(b, None)
        return k

    @staticmethod
    def _lasting(batch: int, staying: Callable[[], int] | None) -> bool:
        """Does the batch stay in its bucket for the next step, as far as the engine knows? An exploration's
        second step (the one timed) is dropped when the batch leaves the bucket, so one started where the step
        itself brings enough requests to their length cap would only pay for its first step. A rollout's
        requests start together, so the responses cut at max_tokens all end at one step."""
        if staying is None:
            return True
        n = staying()
        return n > 0 and bucket(n) == bucket(batch)

    def _exploration_gate(self, rival: int, steps: int) -> int:
        """Which exploration choose asks about at a steady step once the model has chosen: 1 a challenge, 2 a
        probe, 0 none is due."""
        if rival >= 0 and self.challenge_every and steps >= self._next_challenge_at:
            return 1
        if self.probe_every and steps >= self._next_probe_at:
            return 2
        return 0

    def _hold_after(self, batch: int, calibration: tuple[float, bool]) -> _Hold:
        """Records a full choice of k = 0 that started no exploration at a steady step; in a bucket not timed at
        every k, with what its calibration check found (`calibration`: _calibration_regret's answer, or (inf, True)
        where the check did not run)."""
        key, (_, rival, seconds) = self._memo   # type: ignore[misc]
        fit = key[3][0]   # _model_choice's key: (batch, bucket, incumbent, cost.state(batch), ...)
        gate = self._exploration_gate(rival, self.steps)
        # a due exploration that did not start was refused by _two_steps_affordable, which memoized its regret,
        # or is a probe waiting for a smaller batch (_cheaper_at_a_smaller_batch): at this batch, only its deadline
        regret = (math.inf if gate == 2 and self._probe_deferred
                  else self._regret_memo[1] if gate else 0.0)   # type: ignore[index]
        settled = self._settled is not None and self._settled[:2] == (key[1:], True)
        timed = fit is not self.cost.global_fit   # (as _model_choice tells a bucket timed at every k)
        return _Hold(batch, rival, seconds, self.cost, fit, fit._solved, self.acceptance,
                     self.acceptance.version, self._settle_version, gate, regret,
                     self._settled[2] if settled else 0, self.cost.lines_in_state(key[3]) if settled else None,
                     None if timed else self.cost.version, *calibration)

    def _held(self, hold: _Hold, batch: int, steady: bool) -> bool:
        """choose's fast path. The engine's plain steps mostly repeat the last one's batch, or stay in a bucket
        where not drafting is settled (_model_choice), with nothing new timed into the fit's solve, no new
        acceptance and no exploration allowed to start; the full choice (its memo keys, the exploration checks)
        would then only say the same again. Where all of that holds, this does the step's bookkeeping exactly
        as the full choice would and returns True; else it changes nothing and the full choice runs.

        A step that takes prompt tokens (not `steady`) starts no exploration, so only the choice itself has to
        hold there. A rollout's batch leaves a bucket and comes back (its tail, the next rollout), so each
        bucket keeps the hold of its own last full choice; a due exploration is decided by the full choice
        unless the hold is the latest full choice's, since full choices in other buckets since then may have
        moved what it waits for (a deferred probe, the budget it waits on). In a bucket not timed at every k the
        calibration check must also say the same: nothing it reads changed (the cost model's version) and its
        regret still exceeds the budget, at the same batch (or one it does not depend on)."""
        same = batch == hold.batch
        if ((not same and batch > hold.settled_top)
                or self._queue or hold.fit._solved is not hold.solution or hold.cost is not self.cost
                or hold.acceptance is not self.acceptance or self.acceptance.version != hold.acceptance_version
                or self._settle_version != hold.settle_version):
            return False
        if hold.cost_version is not None:   # a bucket not timed at every k: its calibration check must say the same
            if hold.cost_version != self.cost.version:
                return False
            if steady and (
                    not (same or hold.calibration_anywhere)
                    or hold.calibration <= self.explore_budget * (self._spent - self._spent_at_probe)):
                return False
        # another batch size of a settled bucket: k = 0, no rival, its time read off the same line (_model_choice)
        seconds = hold.seconds if same else hold.lines.prediction(0, float(batch))   # type: ignore[union-attr]
        steps, spent = self.steps + 1, self._spent + seconds
        gate = self._exploration_gate(hold.rival, steps) if steady else 0
        if gate and (hold is not self._hold or not same or gate != hold.gate
                     or hold.regret <= self.explore_budget * (spent - self._spent_at_probe)
                     or (math.isinf(hold.regret) and steps >= self._probe_deadline)):
            return False    # an exploration may start here (its regret depends on the batch): the full choice decides
        self.steps, self._spent = steps, spent   # the held choice is k = 0 (_hold_after): chosen_sum stays
        self.chosen_count += 1
        self.histogram[0] += 1
        self.model_histogram[0] += 1
        self._track_settling(0, False)
        self.held_steps += 1
        return True

    def _track_settling(self, k: int, explored: bool) -> None:
        """Which of the plain steps back at the model's k = 0 after drafting this one is (`settling`)."""
        if k:
            self._back, self.settling = 0, -1
            return
        # the first step back verifies the last drafts (the exploration's own cost); an exploration's queued
        # k = 0 steps (a calibration cycle's) count along but are timed for the fit as they always were
        self._back = min(self._back + 1, self.settle_steps + 2)
        self.settling = self._back - 2 if not explored and 2 <= self._back < self.settle_steps + 2 else -1

    @property
    def settle_seconds(self) -> float:
        """What the plain steps after an exploration that returns to k = 0 take beyond k = 0's fitted time,
        summed over the positions timed so far (what is known; each at least 0)."""
        return sum(max(e, 0.0) for e in self.settle_excess)   # a position not timed yet holds 0

    def observe_settle(self, position: int, num_tokens: int, batch: int, seconds: float) -> None:
        """A steady step at k = 0, `position` steps into the settling after an exploration (`settling` when
        it was chosen): its time beyond k = 0's fitted time, a stall clipped as CostModel.observe clips it."""
        if not 0 <= position < self.settle_steps:
            raise ValueError(f"settle position {position} outside 0..{self.settle_steps - 1}")
        predicted = max(self.cost.predict(num_tokens, batch, 0), 1e-6)
        excess = min(seconds, self.cost.stall_ratio * predicted) - predicted
        w = self.settle_weight[position] = self.settle_decay * self.settle_weight[position] + 1.0
        self.settle_excess[position] += (excess - self.settle_excess[position]) / w
        self._settle_version += 1

    def _model_choice(self, batch: int) -> int:
        """best_k, computed again only when its inputs changed (the engine asks every step; between timed
        steps, acceptance updates and re-solves of the fit, it gets the same answer). A rollout's draining
        tail brings a new batch size every step or two; where not drafting provably holds across the bucket
        (settled_across: k = 0 and no rival at every size in it), it is not computed again for each size."""
        b = bucket(batch)
        cost = self.cost
        state = cost.state(batch)
        span = (b, self._incumbent.get(b, 0), state, self.acceptance, self.acceptance.version)
        key = (batch, *span)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1][0]
        if self._settled is not None and self._settled[:2] == (span, True) and batch <= self._settled[2]:
            self._memo = (key, (0, -1, cost.line_seconds(batch, 0)))
            return 0
        alphas = self.acceptance.rates()
        table = cost.table_in_state(state, batch)
        best, rates = best_k_in_table(alphas, table, self.k_max, span[1])
        covered = state[0] is not cost.global_fit   # (CostModel._fit: the bucket's own fit once it covers)
        if best and not covered:
            best = 0   # drafting is adopted on this batch size's own timings only, never extrapolated
        rival = plausible_rival_in_table(alphas, table, self.k_max, best, rates)
        self._memo = (key, (best, rival, table.seconds[best]))
        # judged once per bucket and inputs, and only where the bucket does not draft: a drafting step changes
        # the acceptance (so the inputs) every step, where the judgement would add work and save none
        if best == 0 and (self._settled is None or self._settled[0] != span):
            top = (1 << b) - 1 if self.max_batch is None else min((1 << b) - 1, max(self.max_batch, batch))
            holds = rival < 0 and (span[1] == 0 or not covered) and settled_across(
                alphas, self.cost, 1 << (b - 1), top, self.k_max, 0)
            self._settled = (span, holds, top)
        return best

    def _calibration_regret(self, batch: int) -> tuple[float, bool]:
        """Time this new bucket at every k now? The regret of its cycle (inf: not due whatever the budget), due
        when within `explore_budget` of the engine time predicted since the last exploration, and whether that
        answer holds at every batch size of the bucket. Due only if drafting may pay here (the live acceptance
        can gain `min_gain` tokens per step, and the fit so far, taken one standard error in drafting's favour
        (_hopeful_costs), puts the best k > 0 within `calibrate_within` of k = 0) and the cycle fits the
        probes' exploration budget: its regret against k = 0 (what the bucket runs until it has been timed), at
        those costs, within `explore_budget` of the engine time predicted since the last exploration. Steps
        the cycle spends at k = 0, or deeper with drafts that pay for themselves, cost nothing (where
        drafting pays, the cycle runs at once); the rest makes it wait, so calibrating the
        buckets a rollout's tail passes through (64, 32, ..., 1 sequences left) is spread over the run
        instead of front-loaded."""
        alphas = self.acceptance.rates()
        tokens = [expected_tokens(alphas, k) for k in range(self.k_max + 1)]
        if tokens[-1] < 1.0 + self.min_gain:
            return math.inf, True
        if not self.timing_valid:
            return 0.0, False
        hopeful = self._hopeful_costs(max(batch, 1))
        rates = [t / c for t, c in zip(tokens, hopeful)]
        if max(rates[1:]) < (1.0 - self.calibrate_within) * rates[0]:
            return math.inf, False
        # against k = 0, what a bucket not yet timed at every k runs (_model_choice)
        cycle = self._calibration(batch)
        return sum(regret_from_costs(alphas, hopeful, k, 0) for k in cycle) + self.settle_seconds * any(cycle), False

    def _hopeful_costs(self, batch: int) -> list[float]:
        """Step time per k, taken one standard error (of its difference to k = 0) below the fit's prediction,
        but never below k = 0's time plus what the drafts are known to add at a smaller batch
        (CostModel.draft_seconds_floor). A bucket's calibration is judged on these: a fit that has timed
        drafts at one batch only cannot tell a draft's fixed cost from its per-request cost, and extrapolated
        to a larger batch its prediction can be several times too high, with a standard error to match; the
        cycle is what finds out, and it runs once per bucket."""
        table = self.cost.table(batch)
        seconds, sd = table.seconds, table.difference_sd
        floors = self.cost.draft_seconds_floors(batch)
        base = seconds[0]
        return [base] + [max(seconds[k] - sd[k][0], base + floors[k]) for k in range(1, self.k_max + 1)]

    def _challenge(self, best: int, rival: int, batch: int, staying: Callable[[], int] | None = None) -> int:
        """Two steps at a plausible rival (plausible_rival: it may beat the best k within the fit's standard
        error), when its predicted regret fits the exploration budget, `challenge_every` steps after the
        choice moved, then backing off (the gap doubles, up to `probe_every_max`) while the choice stays: a
        rival that keeps looking plausible on a noisy machine costs a shrinking share of the steps. The margin
        that keeps the incumbent (best_k) shrinks only as both ks are timed, and the probes' interval backs
        off to hundreds of steps; without this, a k the fit has timed a few times (k = 0 after a head that was
        accepted well stops being accepted) could keep losing to the incumbent on doubt alone for as long."""
        if not self._two_steps_affordable(rival, best, batch) or not self._lasting(batch, staying):
            return best
        self._spent_at_probe = self._spent
        self._next_challenge_at = self.steps + self._challenge_gap
        self._challenge_gap = min(2 * self._challenge_gap, max(self.probe_every_max, self.challenge_every))
        self._queue, self._queue_bucket, self._queue_calibrates = [rival], bucket(batch), False
        return rival

    def _probe_step(self, best: int, batch: int, staying: Callable[[], int] | None = None) -> int:
        """Probes back off while they change nothing (the interval doubles up to `probe_every_max` and
        returns to `probe_every` when the best k moves), and wait while their predicted regret exceeds
        `explore_budget` of the time since the last one: they stay a small share of the time whichever way
        they move from the best k, and a head that improves is still noticed."""
        k = self._next_probe(best, self._probe + 1)
        # two steps, the second steady (timed): a probe measures the cost of its k as well as (deeper) the
        # next position's acceptance, so best_k's margin for switching to it shrinks as evidence accumulates
        self._probe_deferred = False
        if not self._two_steps_affordable(k, best, batch):
            return best
        if self._cheaper_at_a_smaller_batch(k, best, batch):
            self._probe_deferred = True
            return best
        if not self._lasting(batch, staying):   # due and affordable: it starts at the next step that lasts
            return best
        self._probe += 1
        self._spent_at_probe = self._spent
        self._queue, self._queue_bucket, self._queue_calibrates = [k], bucket(batch), False
        self._interval = min(2 * self._interval, max(self.probe_every_max, self.probe_every))
        self._next_probe_at = self.steps + self._interval
        return k

    def _two_steps_affordable(self, k: int, best: int, batch: int) -> bool:
        """Two steps at k instead of best fit the exploration budget: their predicted regret is within
        `explore_budget` of the engine time predicted since the last exploration (probe or challenge).

        A step verifies the drafts of the step before it, so the excursion touches three steps: the first
        drafts at k and verifies best's drafts, the second is a steady step at k, and the step back drafts at
        best and verifies k's drafts. The first and the last together do about the work of one steady step at
        each k, so the excursion costs two steady steps at k in place of two at best."""
        # a probe waiting for its budget asks every step; its regret changes only with _model_choice's inputs
        key = (batch, k, best, self.acceptance, self.acceptance.version, self.cost.state(batch), self._settle_version)
        if self._regret_memo is None or self._regret_memo[0] != key:
            self._regret_memo = (key, self._excursion_regret(batch, k, best))
        return self._regret_memo[1] <= self.explore_budget * (self._spent - self._spent_at_probe)

    def _excursion_regret(self, batch: int, k: int, best: int) -> float:
        """What two steps at k instead of best are predicted to cost (_two_steps_affordable), with the settling
        after them when they leave k = 0."""
        extra = 2 * regret_seconds(self.acceptance.rates(), self.cost, batch, k, best)
        return extra + self.settle_seconds if best == 0 else extra

    @property
    def _probe_deadline(self) -> int:
        """The step by which a due probe runs even at a batch where it costs more: one more probe interval
        after it fell due, so a probe waits at most as long again as the interval before it."""
        return self._next_probe_at + self._interval

    def _cheaper_at_a_smaller_batch(self, k: int, best: int, batch: int) -> bool:
        """Should a probe from k = 0, due and affordable here, wait for a smaller batch? Yes where its predicted
        regret here (_two_steps_affordable's) is more than `probe_cheaper_by` times its regret at the smallest
        batch size the engine has timed at every k (the lower end of the smallest covered bucket), for at
        most one probe interval (_probe_deadline). A probe from k = 0 learns the next position's acceptance,
        the same at any batch, and its k's cost here; where that k costs several times more here than
        there (a full batch on CPU: a draft step about doubles it), the cost it would time is the one least
        likely to pay, and every rollout's tail passes through the small batches where it is cheap. Not
        where the engine drafts here (best > 0: this batch's costs are the ones that decide), and not past
        the deadline, so the costs at a large batch are still timed now and then."""
        if best or not math.isfinite(self.probe_cheaper_by) or self.steps >= self._probe_deadline:
            return False
        covered = self.cost.covered_buckets()
        if not covered or covered[0] >= bucket(batch):
            return False
        small = 1 << (covered[0] - 1)
        key = (small, k, self.acceptance, self.acceptance.version, self.cost.state(small), self._settle_version)
        if self._small_regret_memo is None or self._small_regret_memo[0] != key:
            self._small_regret_memo = (key, self._excursion_regret(small, k, 0))
        return self._regret_memo[1] > self.probe_cheaper_by * self._small_regret_memo[1]   # type: ignore[index]

    def _next_probe(self, best: int, probe: int) -> int:
        """In turn: a neighbour of the best k, shallower then deeper, then k = 0 (the ones that exist and
        differ from the best). Deeper probes measure the next position's acceptance, shallower ones the cost
        saved; a neighbour is the cheapest informative probe (from k = 0 only one draft step is paid). And
        k = 0 is the only step that times a step without drafting: the fit cannot tell drafting's fixed cost
        from the rest of a step otherwise, so a k = 0 timed slow once, or timed long ago, would keep deep
        drafting looking nearly free when the head stops being accepted."""
        turns = [k for k in dict.fromkeys((best - 1, best + 1, 0)) if 0 <= k <= self.k_max and k != best]
        return turns[(probe - 1) % len(turns)]

    def on_new_weights(self) -> None:
        """The engine got new weights: the acceptance seen so far was the old head's (and target's)."""
        self.acceptance.refresh(self.refresh_attempts)

    def observe_verified(self, batch: int, num_drafts: list[int], num_accepted: list[int]) -> None:
        """What a verify step of `batch` requests tells the policy: the acceptance per position, and the engine
        time its accepted drafts saved (credit_verified). The engine core's scheduler and a trace's replay
        both feed it through here."""
        self.acceptance.observe(num_drafts, num_accepted)
        self.credit_verified(batch, num_drafts, num_accepted)

    def credit_verified(self, batch: int, num_drafts: list[int], num_accepted: list[int]) -> float:
        """One verify step of `batch` requests (per request that carried drafts: drafts scheduled, drafts
        accepted): add what it saved (step_savings at the fitted costs of its batch) to `seconds_saved`, and
        return it."""
        if not any(num_drafts):
            return 0.0
        batch = max(int(batch), len(num_drafts), 1)
        k = min(int(max(num_drafts)), self.k_max)
        saved = step_savings(self.cost.table(batch).monotone, k, sum(num_accepted) / batch)
        self.seconds_saved += saved
        return saved

    def stats(self) -> dict[str, Any]:
        return {"steps": self.chosen_count, "k_sum": self.chosen_sum, "k_histogram": list(self.histogram),
                "explore_budget": self.explore_budget, "max_batch": self.max_batch, "held_steps": self.held_steps,
                "model_k_histogram": list(self.model_histogram), "explored_steps": self.explored_steps,
                "acceptance_per_pos": self.acceptance.rates(),
                "attempts_per_pos": list(self.acceptance.attempts),
                "calibrated_buckets": self.cost.covered_buckets(), "seconds_saved": self.seconds_saved,
                "settle_seconds": self.settle_seconds, "settle_excess_per_pos": list(self.settle_excess),
                "settle_timings_per_pos": list(self.settle_weight)}


# ----------------------------------------------------------------------------------- the vLLM hook

def _require(ok: bool, what: str) -> None:
    if not ok:
        raise AdaptiveSpeculationError(f"vLLM changed: {what}; skyrl_mtp's adaptive speculation must be updated "
                                       "for this vLLM version (or set trainer.mtp.num_speculative_tokens to an int)")


def _params(fn: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


SCHEDULER_CLS = "skyrl_mtp.speculation.scheduler_hook.AdaptiveSpeculationScheduler"


def check_runner(runner: Any) -> None:
    """Every name the hook relies on, checked before anything is patched."""
    from dataclasses import fields

    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    name = type(runner).__name__
    for attr in ("propose_draft_token_ids", "take_draft_token_ids", "drafter", "speculative_config", "_sample",
                 "sampler", "device", "execute_model", "sample_tokens", "execute_model_state"):
        _require(hasattr(runner, attr), f"model runner {name} has no `{attr}`")
    got = _params(runner._sample)
    _require(got == SAMPLE_PARAMS, f"{name}._sample parameters are {got}, expected {SAMPLE_PARAMS}")
    got = _params(runner.propose_draft_token_ids)
    _require(got[:len(PROPOSE_PARAMS)] == PROPOSE_PARAMS,
             f"{name}.propose_draft_token_ids parameters are {got}, expected them to start with {PROPOSE_PARAMS}")
    got = _params(runner.drafter.propose)
    _require(all(p in got for p in DRAFTER_PROPOSE_PARAMS),
             f"{type(runner.drafter).__name__}.propose parameters are {got}, expected {DRAFTER_PROPOSE_PARAMS}")
    _require("num_spec_tokens_to_schedule" in {f.name for f in fields(SchedulerOutput)},
             "SchedulerOutput has no field num_spec_tokens_to_schedule")
    _require("num_draft_tokens" in {f.name for f in fields(SpecDecodeMetadata)},
             "SpecDecodeMetadata has no field num_draft_tokens")
    _require("scheduled_spec_decode_tokens" in {f.name for f in fields(SchedulerOutput)},
             "SchedulerOutput has no field scheduled_spec_decode_tokens")
    from vllm.v1.worker.gpu_model_runner import ExecuteModelState

    missing = set(STATE_FIELDS) - set(ExecuteModelState._fields)
    _require(not missing, f"ExecuteModelState has no field(s) {sorted(missing)}")
    par = getattr(runner, "parallel_config", None)
    world = 1 if par is None else par.tensor_parallel_size * par.pipeline_parallel_size * par.data_parallel_size
    if world != 1:
        raise AdaptiveSpeculationError(f"adaptive speculation supports one worker per engine (tp=pp=dp=1), got "
                                       f"{world} ranks; set trainer.mtp.num_speculative_tokens to an int")
    spec = runner.speculative_config
    _require(spec is not None and getattr(spec, "num_speculative_tokens_per_batch_size", None),
             "the engine was built without num_speculative_tokens_per_batch_size (dynamic speculative "
             "decoding), so the scheduler would pad drafts to k_max")
    sched = getattr(getattr(runner, "vllm_config", None), "scheduler_config", None)
    got = getattr(sched, "scheduler_cls", None)
    if not _is_adaptive_scheduler(got):   # the worker only follows; without the engine-core half k would stay k_max
        raise AdaptiveSpeculationError(f"the engine's scheduler_cls is {got!r}; adaptive speculation needs "
                                       f"{SCHEDULER_CLS!r} or a subclass (EngineConfig(adaptive_speculation=True) "
                                       "sets it)")


def _is_adaptive_scheduler(cls: Any) -> bool:
    """vLLM's scheduler_cls (a class or its qualified name) is the adaptive scheduler or a subclass of it."""
    import importlib

    from skyrl_mtp.speculation.scheduler_hook import AdaptiveSpeculationScheduler

    if cls == SCHEDULER_CLS or cls is AdaptiveSpeculationScheduler:
        return True
    if isinstance(cls, str) and "." in cls:
        module, _, name = cls.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return False
    return isinstance(cls, type) and issubclass(cls, AdaptiveSpeculationScheduler)


def plain_steps_supported(runner: Any) -> tuple[bool, str]:
    """Can a step with no drafts either way run as a no-spec step on this runner? (and if not, why)"""
    if getattr(runner, "use_async_scheduling", True):
        return False, "async scheduling carries draft state between steps"
    if getattr(getattr(runner, "model_config", None), "is_hybrid", True):
        return False, "a hybrid (recurrent) model keeps zero-draft decode rows speculative"
    return True, ""


class _Hook:
    """The worker half: follows the k the engine core's scheduler chose (SchedulerOutput
    .num_spec_tokens_to_schedule) and makes a k = 0 step cost what a no-spec step costs. Wraps one runner
    instance's methods (instance attributes; the class is untouched) and records what it saw."""

    def __init__(self, runner: Any, k_max: int):
        import functools

        self.runner, self.k_max = runner, k_max
        self.histogram = [0] * (k_max + 1)
        self.skipped_drafter = 0
        self.plain_sampled_steps = 0
        self.plain_steps = 0
        self.draft_fetches = 0
        self.plain_supported, self.plain_unsupported_why = plain_steps_supported(runner)
        self._plain_pending = False
        orig_propose = runner.propose_draft_token_ids
        orig_take = runner.take_draft_token_ids
        orig_sample_logits = runner._sample
        orig_execute = runner.execute_model
        orig_sample_tokens = runner.sample_tokens

        def propose_draft_token_ids(scheduler_output, sampled_token_ids, *args, **kwargs):
            k = self._count_k(scheduler_output)
            if k == 0:
                # vLLM's runner would still build the drafter's inputs (next tokens, attention metadata)
                # before the drafter is skipped; no drafts are needed, so none of that is done (and the
                # engine core does not fetch drafts after this step: adaptive_scheduler.py)
                import torch

                self.skipped_drafter += 1
                return torch.empty(len(scheduler_output.num_scheduled_tokens), 0, dtype=torch.int64,
                                   device=runner.device)
            return orig_propose(scheduler_output, sampled_token_ids, *args, **kwargs)

        def sample_logits(logits, spec_decode_metadata):
            # A step in which no request carries a draft: the rejection sampler would only draw the bonus
            # token, which is what the plain sampler draws (same generators, same logprobs), at a fraction
            # of the cost; vLLM's runner still routes such steps through it once drafting is configured.
            if spec_decode_metadata is not None and not any(spec_decode_metadata.num_draft_tokens):
                self.plain_sampled_steps += 1
                return orig_sample_logits(logits, None)
            return orig_sample_logits(logits, spec_decode_metadata)

        def take_draft_token_ids():
            self.draft_fetches += 1    # the engine core's fetch (a round trip with the mp executor)
            return orig_take()

        @functools.wraps(orig_execute)
        def execute_model(scheduler_output, *args, **kwargs):
            # Nothing to verify and nothing to propose: run the step as vLLM runs it without speculation
            # (its runner tests `speculative_config is not None` to take the speculative path).
            self._plain_pending = False
            if (not self.plain_supported or scheduler_output.scheduled_spec_decode_tokens
                    or scheduler_output.num_spec_tokens_to_schedule):
                return orig_execute(scheduler_output, *args, **kwargs)
            out = self._without_speculation(orig_execute, scheduler_output, *args, **kwargs)
            state = runner.execute_model_state
            if state is None:    # an empty step (nothing scheduled): no sample_tokens follows
                return out
            for name in STATE_FIELDS:
                _require(getattr(state, name) is None,
                         f"with speculative_config=None, {type(runner).__name__}.execute_model still built "
                         f"{name}, so a k = 0 step cannot run as a no-spec step")
            self._count_k(scheduler_output)
            self.skipped_drafter += 1
            self.plain_steps += 1
            self._plain_pending = True
            return out

        @functools.wraps(orig_sample_tokens)
        def sample_tokens(*args, **kwargs):
            if not self._plain_pending:
                return orig_sample_tokens(*args, **kwargs)
            self._plain_pending = False
            return self._without_speculation(orig_sample_tokens, *args, **kwargs)

        runner._sample = sample_logits
        runner.propose_draft_token_ids = propose_draft_token_ids
        runner.take_draft_token_ids = take_draft_token_ids
        runner.execute_model = execute_model
        runner.sample_tokens = sample_tokens

    def _count_k(self, scheduler_output: Any) -> int:
        k = int(scheduler_output.num_spec_tokens_to_schedule)
        if not 0 <= k <= self.k_max:
            raise AdaptiveSpeculationError(f"the scheduler sent num_spec_tokens_to_schedule={k}, outside "
                                           f"0..{self.k_max}")
        self.histogram[k] += 1
        return k

    def _without_speculation(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        spec = self.runner.speculative_config
        self.runner.speculative_config = None
        try:
            return fn(*args, **kwargs)
        finally:
            self.runner.speculative_config = spec

    def stats(self) -> dict[str, Any]:
        steps = sum(self.histogram)
        return {"steps": steps, "k_sum": float(sum(k * n for k, n in enumerate(self.histogram))),
                "k_histogram": list(self.histogram),
                "skipped_drafter_steps": self.skipped_drafter, "plain_sampled_steps": self.plain_sampled_steps,
                "plain_steps": self.plain_steps, "draft_fetches": self.draft_fetches}


def explore_budget_from_env(environ: Mapping[str, str]) -> float:
    """The engine's exploration budget (EXPLORE_BUDGET_ENV, set by the engine process), or the policy's
    default when the engine was built without it."""
    raw = environ.get(EXPLORE_BUDGET_ENV)
    if raw is None:
        return DEFAULT_EXPLORE_BUDGET
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not is_explore_budget(value):
        raise AdaptiveSpeculationError(f"{EXPLORE_BUDGET_ENV}={raw!r} is invalid: {EXPLORE_BUDGET_ALLOWED} "
                                       "(trainer.mtp.explore_budget)")
    return value


def install(runner: Any) -> _Hook:
    """Check the runner, then wrap it; k_max is the engine's num_speculative_tokens."""
    if getattr(runner, "_skyrl_adaptive_hook", None) is not None:
        return runner._skyrl_adaptive_hook
    check_runner(runner)
    k = int(runner.speculative_config.num_speculative_tokens)
    hook = _Hook(runner, k)
    runner._skyrl_adaptive_hook = hook
    logger.info("skyrl_mtp adaptive speculation (worker half) installed on %s (k_max=%d)", type(runner).__name__, k)
    if not hook.plain_supported:
        logger.info("skyrl_mtp adaptive speculation: k = 0 steps keep vLLM's speculative bookkeeping (%s)",
                    hook.plain_unsupported_why)
    return hook


def dynamic_schedule(k_max: int, max_num_seqs: int) -> list[tuple[int, int, int]]:
    """The `num_speculative_tokens_per_batch_size` that puts vLLM's scheduler in dynamic mode with every
    batch size allowed up to k_max; the adaptive scheduler (adaptive_scheduler.py) picks the actual k each step."""
    return [(1, max(int(max_num_seqs), 1), int(k_max))]
