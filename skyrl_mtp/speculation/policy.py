"""Auto k: how many tokens to draft at each engine step, chosen from what the running engine measures.

Why this exists: MTP drafting pays only when the drafts the target accepts save more target steps than
drafting and the longer verify cost. Both sides move. A draft step costs little next to a target forward
at a small batch and about as much as one at a large batch (the verify forward grows with the tokens it
checks), and acceptance moves as the head is trained. So a fixed k loses where the batch is large or the
head is poor, and the k that pays differs between the start of an RL rollout (every request running) and
its tail (a few long responses left).

The policy, per batch-size bucket (1, 2, 3-4, 5-8, ..., powers of two):
- step time: the engine's own timings of steady steps (decode only, at the same k as the step before, so
  each verifies what it drafts). k = 0's time is a line in the batch size; each k > 0 is its time over
  k = 0's line at the batches it was timed at (a ratio, so timings at different batches in the bucket
  compare).
- acceptance: per draft position, conditional on the earlier ones (what the rejection sampler kept),
  decayed so it follows the head, and cut to a few steps' worth at each weight sync.
- choice: the k with the most expected tokens per second, E(k) / ratio(k), over the ks timed in the
  bucket (k = 0 until the bucket is timed). At k = 0 the engine runs no drafter (worker_hook.py).
- exploration: a bucket's first steady steps time each k it has not timed (two steps each, the second
  timed), once per engine; after that, at most one probe every PROBE_GAP steps re-times the k the bucket
  timed longest ago, when its predicted cost beyond the best k fits `explore_budget` of the engine time
  since the last probe. Explorations start on steady steps and stop when the batch leaves the bucket.

Pure Python, no vLLM: the engine core's scheduler (scheduler_hook.py) feeds it, and tests and benchmarks
drive it on modelled costs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from skyrl_mtp.allowed import DEFAULT_EXPLORE_BUDGET, EXPLORE_BUDGET_ALLOWED, is_explore_budget

PROBE_GAP = 16           # engine steps between two probes at least
PLAIN_DECAY = 0.98       # per timed step at k = 0 (its line needs a spread of batch sizes)
DRAFT_DECAY = 0.9        # per timed step at a k > 0
REFRESH_ATTEMPTS = 16.0  # a weight sync leaves each position's acceptance this many drafts' weight


def bucket(batch: int) -> int:
    """Batch-size bucket: 0 for 1 request, 1 for 2, 2 for 3-4, 3 for 5-8, ... (5-8 ends at 8 requests)."""
    return max(int(batch) - 1, 0).bit_length()


def bucket_label(b: int) -> str:
    lo, hi = (1 << (b - 1)) + 1 if b else 1, 1 << b
    return str(hi) if lo == hi else f"{lo}-{hi}"


def expected_tokens(alphas: list[float], k: int) -> float:
    """Tokens a request emits per step with k drafts; alphas[i] = P(draft i+1 accepted | 1..i accepted)."""
    total = run = 1.0
    for a in alphas[:k]:
        run *= a
        total += run
    return total


@dataclass
class Acceptance:
    """Per-position conditional acceptance, decayed per verify step (a position only when it was tried)."""

    k_max: int
    decay: float = 0.97
    attempts: list[float] = field(default_factory=list)
    accepts: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.attempts, self.accepts = [0.0] * self.k_max, [0.0] * self.k_max

    def observe(self, drafts: list[int], accepted: list[int]) -> None:
        """One verify step: per request, drafts it carried and how many were accepted (a prefix)."""
        tried, kept = [0] * self.k_max, [0] * self.k_max
        for (d, a), n in Counter(zip(drafts, accepted)).items():   # a large batch repeats a few pairs
            d = min(int(d), self.k_max)
            a = max(0, min(int(a), d))
            for i in range(min(a + 1, d)):   # position i is tried when 1..i were accepted
                tried[i] += n
                kept[i] += n * (i < a)
        for i in range(self.k_max):
            if tried[i]:
                self.attempts[i] = self.attempts[i] * self.decay + tried[i]
                self.accepts[i] = self.accepts[i] * self.decay + kept[i]

    def refresh(self) -> None:
        """New weights: keep each rate, but at most REFRESH_ATTEMPTS drafts' weight, so the new head's drafts
        soon outweigh the old head's."""
        for i in range(self.k_max):
            if self.attempts[i] > REFRESH_ATTEMPTS:
                scale = REFRESH_ATTEMPTS / self.attempts[i]
                self.attempts[i] *= scale
                self.accepts[i] *= scale

    def rates(self) -> list[float]:
        """Each position's rate, with one prior draft accepted half the time (0.5 before any evidence)."""
        return [(acc + 0.5) / (att + 1.0) for acc, att in zip(self.accepts, self.attempts)]


@dataclass
class BucketCosts:
    """Step times of one bucket: k = 0 as a decayed least-squares line in the batch size, each k > 0 as the
    decayed mean of its times and batches (its ratio: that mean over k = 0's line at that batch)."""

    k_max: int
    plain: list[float] = field(default_factory=lambda: [0.0] * 5)   # decayed sums: w, b, b^2, t, b t
    drafted: list[list[float]] = field(default_factory=list)         # per k > 0: decayed w, b, t
    last_timed: list[int] = field(default_factory=list)              # per k: the step it was last timed at

    def __post_init__(self) -> None:
        self.drafted = [[0.0] * 3 for _ in range(self.k_max)]
        self.last_timed = [-1] * (self.k_max + 1)

    def observe(self, batch: int, k: int, seconds: float, step: int) -> None:
        self.last_timed[k] = step
        if k == 0:
            sums, decay, xs = self.plain, PLAIN_DECAY, (1.0, batch, batch * batch, seconds, batch * seconds)
        else:
            sums, decay, xs = self.drafted[k - 1], DRAFT_DECAY, (1.0, batch, seconds)
        for i, x in enumerate(xs):
            sums[i] = sums[i] * decay + x

    def timed(self, k: int) -> bool:
        return self.last_timed[k] >= 0 and self.last_timed[0] >= 0

    def plain_seconds(self, batch: float) -> float:
        """k = 0's step time at this batch: its line (flat where its timings barely spread), never below 0."""
        w, sb, sbb, st, sbt = self.plain
        mb, mt = sb / w, st / w
        var = sbb / w - mb * mb
        slope = max((sbt / w - mb * mt) / var, 0.0) if var > (0.05 * mb) ** 2 else 0.0
        return max(mt + slope * (batch - mb), 1e-6)

    def ratio(self, k: int) -> float:
        """Step time at k over k = 0's, both where k was timed (1 at k = 0). Needs timed(k)."""
        if k == 0:
            return 1.0
        w, sb, st = self.drafted[k - 1]
        return (st / w) / self.plain_seconds(sb / w)


class SpeculationPolicy:
    """Chooses k per engine step. The scheduler calls choose() before each step, step_seconds() after it,
    observe_verified() when it verified drafts, and on_new_weights() at each weight sync."""

    def __init__(self, k_max: int, explore_budget: float = DEFAULT_EXPLORE_BUDGET):
        if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
            raise ValueError(f"k_max={k_max!r} is invalid: auto k drafts at most an int >= 1 tokens")
        if not is_explore_budget(explore_budget):
            raise ValueError(f"explore_budget={explore_budget!r} is invalid: {EXPLORE_BUDGET_ALLOWED}")
        self.k_max, self.explore_budget = k_max, float(explore_budget)
        self.acceptance = Acceptance(k_max)
        self.buckets: dict[int, BucketCosts] = {}
        self.steps = self.explored_steps = 0
        self.seconds_saved = 0.0   # engine time the verified drafts saved, at the fitted costs (may be < 0)
        self.histogram = [0] * (k_max + 1)         # steps per k run
        self.model_histogram = [0] * (k_max + 1)   # steps per k chosen, exploration aside
        self.bucket_histogram: dict[int, list[int]] = {}
        self._queue: list[int] = []   # an exploration's steps to come, for bucket _queue_bucket
        self._queue_bucket = -1
        self._credit = 0.0            # exploration budget not yet spent, in predicted engine seconds
        self._last_probe = -PROBE_GAP
        self._prev_k = -1
        self._step: tuple[int, int, bool] | None = None   # (batch, k, timed) of the step just chosen

    def costs(self, batch: int) -> BucketCosts:
        b = bucket(batch)
        if b not in self.buckets:
            self.buckets[b] = BucketCosts(self.k_max)
        return self.buckets[b]

    def best(self, batch: int) -> int:
        """The k with the most expected tokens per second among the ks timed in the batch's bucket."""
        costs, alphas = self.costs(batch), self.acceptance.rates()
        timed = [k for k in range(self.k_max + 1) if costs.timed(k)]
        return max(timed, key=lambda k: (expected_tokens(alphas, k) / costs.ratio(k), -k), default=0)

    def regret(self, batch: int, k: int, best: int) -> float:
        """Predicted engine seconds one step at k takes beyond what `best` needs for the tokens k emits."""
        costs, alphas = self.costs(batch), self.acceptance.rates()
        per_token = costs.ratio(best) / expected_tokens(alphas, best)
        return max(costs.ratio(k) - per_token * expected_tokens(alphas, k), 0.0) * costs.plain_seconds(batch)

    def choose(self, batch: int, steady: bool = True) -> int:
        """k for an engine step of `batch` requests; `steady`: it schedules decode tokens only (it can be timed,
        and an exploration may start or go on there)."""
        b, costs = bucket(batch), self.costs(batch)
        if self._queue and (b != self._queue_bucket or not steady):
            self._queue = []   # an exploration is timed in its own bucket only; it resumes on a later visit
        best = self.best(batch)
        if not self._queue and steady:
            self._queue = self._exploration(batch, best, costs)
            self._queue_bucket = b
        k = self._queue.pop(0) if self._queue else best
        if k == best:
            self._credit += self.explore_budget * costs.plain_seconds(batch) * costs.ratio(best) if costs.timed(best) else 0.0
        else:
            self.explored_steps += 1
        self.steps += 1
        self.histogram[k] += 1
        self.model_histogram[best] += 1
        self.bucket_histogram.setdefault(b, [0] * (self.k_max + 1))[k] += 1
        self._step = (batch, k, steady and k == self._prev_k)
        self._prev_k = k
        return k

    def _exploration(self, batch: int, best: int, costs: BucketCosts) -> list[int]:
        """The steps of an exploration to start now: the ks the bucket has not timed (k = 0 first: the others
        are timed against it), or a probe of the k it timed longest ago; [] for none."""
        untimed = [k for k in range(self.k_max + 1) if costs.last_timed[k] < 0]
        if untimed:
            return [k for k in untimed for _ in range(2)]
        if self.steps - self._last_probe < PROBE_GAP:
            return []
        k = min((j for j in range(self.k_max + 1) if j != best), key=lambda j: costs.last_timed[j])
        regret = 2 * self.regret(batch, k, best)
        if regret > self._credit:
            return []
        self._credit -= regret
        self._last_probe = self.steps
        return [k, k]

    def step_seconds(self, seconds: float) -> None:
        """The engine time of the step chosen last, from its schedule to the next one's; only a steady step
        at the k of the step before it is timed into the costs."""
        if self._step is not None and self._step[2]:
            batch, k, _ = self._step
            self.costs(batch).observe(batch, k, seconds, self.steps)
        self._step = None

    def observe_verified(self, batch: int, drafts: list[int], accepted: list[int]) -> None:
        """A step of `batch` requests verified drafts (per request that carried drafts: how many, how many
        accepted): the acceptance per position, and the engine time the accepted drafts saved."""
        if not any(drafts):
            return
        self.acceptance.observe(drafts, accepted)
        k, costs = min(max(drafts), self.k_max), self.costs(batch)
        if costs.timed(k):
            plain = costs.plain_seconds(batch)
            self.seconds_saved += sum(accepted) / max(batch, 1) * plain - (costs.ratio(k) - 1.0) * plain

    def on_new_weights(self) -> None:
        self.acceptance.refresh()

    def stats(self) -> dict[str, Any]:
        """What the engine reports (EngineCore utility, scheduler_hook.py); bucket keys are labels ("3-4")."""
        labels = {b: bucket_label(b) for b in sorted(self.buckets)}
        return {"steps": self.steps, "k_sum": float(sum(k * n for k, n in enumerate(self.histogram))),
                "k_histogram": list(self.histogram), "model_k_histogram": list(self.model_histogram),
                "explored_steps": self.explored_steps, "seconds_saved": self.seconds_saved,
                "explore_budget": self.explore_budget, "acceptance_per_pos": self.acceptance.rates(),
                "attempts_per_pos": list(self.acceptance.attempts),
                "bucket_k_histogram": {labels[b]: list(h) for b, h in sorted(self.bucket_histogram.items())},
                "bucket_cost_ratio": {labels[b]: [c.ratio(k) if c.timed(k) else None for k in range(self.k_max + 1)]
                                      for b, c in sorted(self.buckets.items())}}
