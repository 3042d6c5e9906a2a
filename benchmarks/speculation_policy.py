"""What auto k's policy chooses against the best k, on replayed rollouts of a modelled engine (no vLLM).

Under trainer.mtp.num_speculative_tokens=auto the engine core's scheduler asks the speculation policy
(speculation/policy.py) for k before every step and feeds it the step's time and what was accepted. This
replays RL-like rollouts through the real SpeculationPolicy with a modelled step time in place of the
engine:

- a rollout of `--requests` requests whose lengths are drawn uniformly from [20, 100] tokens: the batch
  starts full and drains as requests finish, through every bucket down to one request;
- step time (`step_cost`): a fixed part, a part per token verified and a part per draft step, shaped like
  the hidden-512 model on CPU (drafting pays at small batches, not at 64), times log-normal noise;
- drafts accepted per position at `acceptance` (0: an untrained head; 0.95: a good one); the weights change
  between rollouts (on_new_weights), as between RL steps.

Per acceptance and exploration budget (`--explore-budget`, as trainer.mtp.explore_budget) it reports
`k_mean`, `k_histogram`, `best_k_share` (steps that ran the best k of the model), `explore_regret_share` and
`choice_regret_share` (the modelled time the explored steps, and those the policy chose, took beyond what
the best k takes for the tokens they emitted, over all the time; each engine's first timing of its buckets
is left out, every engine pays it once), `us_per_step` and `share_of_step` (the policy's own time per step,
and over the modelled step). `--head-improves-at R`: the head is untrained before rollout R and accepted at
`--acceptance` from then on; `rollouts_to_follow_per_seed` counts the rollouts from R until one ran the best
k on half its steps (None: not within `--rollouts`): what the exploration budget buys.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path

from skyrl_mtp.allowed import DEFAULT_EXPLORE_BUDGET
from skyrl_mtp.speculation.policy import SpeculationPolicy, expected_tokens


def step_cost(batch: int, k: int) -> float:
    """Seconds of a steady step: 1 ms, the target's forward (8 ms while reading the weights bounds it, then 0.4
    ms per token verified), and when drafting 2 ms, 1 ms per draft step and 0.05 ms per request and draft step
    (oracle-head speedups of k = 1 / 2 / 3: 1.5 / 2.0 / 2.5x at one request, 1.0-1.06x at 16, 0.9x at 64)."""
    return 0.001 + max(0.008, 0.0004 * batch * (1 + k)) + (0.002 + 0.001 * k + 0.00005 * batch * k if k else 0.0)


def best_k(batch: int, acceptance: float, k_max: int) -> int:
    return max(range(k_max + 1), key=lambda k: expected_tokens([acceptance] * k_max, k) / step_cost(batch, k))


def drain(requests: int, rng: random.Random) -> list[int]:
    lengths = sorted(rng.randint(20, 100) for _ in range(requests))
    return [sum(1 for n in lengths if n > t) for t in range(lengths[-1])]


def replay(seed: int, rollouts: int, requests: int, final_acceptance: float, k_max: int, budget: float,
           improves_at: int = 0) -> dict:
    rng = random.Random(seed)
    policy = SpeculationPolicy(k_max, budget)
    spent = total = explore_regret = choice_regret = counted = 0.0
    steps = at_best = 0
    follows_after = None
    for rollout in range(rollouts):
        policy.on_new_weights()
        acceptance = final_acceptance if rollout >= improves_at else 0.0
        in_rollout = at_best_in_rollout = 0
        for batch in drain(requests, rng):
            t0 = time.perf_counter()
            calibrating = any(c.last_timed[k] < 0 for c in [policy.costs(batch)] for k in range(k_max + 1))
            explored = policy.explored_steps
            k = policy.choose(batch, True)
            explored = policy.explored_steps > explored
            spent += time.perf_counter() - t0
            accepted = []
            for _ in range(batch if k else 0):   # accepted drafts are a prefix
                n = 0
                while n < k and rng.random() < acceptance:
                    n += 1
                accepted.append(n)
            seconds = step_cost(batch, k) * math.exp(rng.gauss(0.0, 0.05))
            t0 = time.perf_counter()
            policy.step_seconds(seconds)
            if k:
                policy.observe_verified(batch, [k] * batch, accepted)
            spent += time.perf_counter() - t0
            best = best_k(batch, acceptance, k_max)
            total += seconds
            steps += 1
            in_rollout += 1
            at_best += k == best
            at_best_in_rollout += k == best
            if not calibrating:
                per_token = step_cost(batch, best) / expected_tokens([acceptance] * k_max, best)
                regret = step_cost(batch, k) - per_token * (1.0 + (sum(accepted) / batch if k else 0.0))
                counted += step_cost(batch, k)
                if explored:
                    explore_regret += regret
                else:
                    choice_regret += regret
        if follows_after is None and rollout >= improves_at and at_best_in_rollout >= 0.5 * in_rollout:
            follows_after = rollout - improves_at
    stats = policy.stats()
    return {"rollouts_to_follow": follows_after, "us_per_step": spent / steps * 1e6, "share_of_step": spent / total,
            "k_mean": stats["k_sum"] / steps, "k_histogram": stats["k_histogram"], "steps": steps,
            "best_k_share": at_best / steps, "explored_share": stats["explored_steps"] / steps,
            "explore_regret_share": explore_regret / counted, "choice_regret_share": choice_regret / counted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=40)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--k-max", type=int, default=3)
    ap.add_argument("--acceptance", type=float, nargs="+", default=[0.0, 0.6, 0.95])
    ap.add_argument("--explore-budget", type=float, nargs="+", default=[DEFAULT_EXPLORE_BUDGET],
                    help="exploration budgets to replay (trainer.mtp.explore_budget)")
    ap.add_argument("--head-improves-at", type=int, default=0, metavar="R",
                    help="the head is untrained (acceptance 0) before rollout R, then accepted at --acceptance")
    ap.add_argument("--quick", action="store_true", help="a few rollouts, for the smoke test")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.rollouts, args.seeds = 4, 2
    rows = []
    for acceptance, budget in ((a, b) for a in args.acceptance for b in args.explore_budget):
        runs = [replay(seed, args.rollouts, args.requests, acceptance, args.k_max, budget, args.head_improves_at)
                for seed in range(args.seeds)]
        rows.append({"acceptance": acceptance, "explore_budget": budget,
                     "us_per_step": statistics.median(r["us_per_step"] for r in runs),
                     "share_of_step": statistics.median(r["share_of_step"] for r in runs),
                     "k_mean": statistics.mean(r["k_mean"] for r in runs),
                     "k_histogram": [sum(r["k_histogram"][k] for r in runs) for k in range(args.k_max + 1)],
                     "steps": sum(r["steps"] for r in runs),
                     "rollouts_to_follow_per_seed": [r["rollouts_to_follow"] for r in runs],
                     **{key: statistics.mean(r[key] for r in runs)
                        for key in ("best_k_share", "explored_share", "explore_regret_share", "choice_regret_share")}})
    print(f"{'acceptance':>10} {'budget':>7} {'us/step':>8} {'share':>7} {'k_mean':>7} {'at best':>8} {'explored':>9} "
          f"{'explore regret':>15} {'choice regret':>14}  k_histogram")
    for r in rows:
        print(f"{r['acceptance']:>10.2f} {r['explore_budget']:>7.3f} {r['us_per_step']:>8.1f} {r['share_of_step']:>7.2%} "
              f"{r['k_mean']:>7.2f} {r['best_k_share']:>8.1%} {r['explored_share']:>9.2%} "
              f"{r['explore_regret_share']:>15.2%} {r['choice_regret_share']:>14.2%}  {r['k_histogram']}")
    if args.head_improves_at:
        print(f"head accepted from rollout {args.head_improves_at}: rollouts until one ran the best k on half its "
              "steps, per seed (None: not within --rollouts)")
        for r in rows:
            print(f"  acceptance {r['acceptance']:.2f}, budget {r['explore_budget']:.3f}: {r['rollouts_to_follow_per_seed']}")
    if args.json:
        args.json.write_text(json.dumps({"rollouts": args.rollouts, "requests": args.requests, "seeds": args.seeds,
                                         "k_max": args.k_max, "head_improves_at": args.head_improves_at,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
