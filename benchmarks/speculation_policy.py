"""What auto k's policy costs per engine step (its own CPU, and its choices' regret against the best k), on replayed rollouts.

Under trainer.mtp.num_speculative_tokens=auto the engine core's scheduler asks the speculation policy
(speculation/policy.py) for k before every step and feeds it the step's timing and, after a
drafting step, what was accepted. That Python work runs on the engine core's critical path, so on a small
model it is part of what auto costs against no speculation (README: step_time's breakdown). This replays
rollouts through the real SpeculationPolicy, without vLLM, and times exactly those calls:

- a rollout of `--requests` requests whose lengths are drawn uniformly from [20, 100] tokens: the batch
  starts full and drains as requests finish (the tail, where the batch size changes every few steps and
  each new size needs the cost model's predictions);
- a modelled engine step time (fixed cost, per token verified, per draft step; noise) fed back as the
  timing, and drafts accepted per position at `acceptance` (0: an untrained head, where auto stays at k=0;
  0.95: where it drafts k_max);
- the weights change between rollouts (on_new_weights), as they do between RL steps.

Prints a table and writes JSON: per acceptance and exploration budget (`--explore-budget`, as
`trainer.mtp.explore_budget`), `us_per_step` (median over seeds of the policy's time per engine step),
`share_of_step` (that over the modelled step time), `k_mean`, `k_histogram`, and what the choices cost
against the best k for the modelled steps (`best_k_share`: the share of steps that ran it;
`explore_regret_share` and `choice_regret_share`: the modelled time of the steps that explored, and of
those the policy chose, beyond what the best k takes for the tokens they emitted, over all the time). The
warm-up's cycles are left out of the regrets: every engine pays them once, whatever the budget.

`--head-improves-at R`: the head is untrained (acceptance 0) for the first R rollouts and accepted at
`--acceptance` from then on, as when training makes it pay; `rollouts_to_follow_per_seed` counts the
rollouts from R until one ran the best k on at least half its steps (None: not within `--rollouts`). That
is what the exploration budget buys.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from skyrl_mtp.speculation.policy import SpeculationPolicy


def step_cost(batch: int, k: int) -> float:
    """A small model's engine step on CPU: ~2 ms fixed, 90 us per token verified (40% more per draft
    position), 3 ms for running the drafter at all (step_seconds adds up to 0.4 ms of noise)."""
    return 0.002 + 0.00009 * batch * (1 + 0.4 * k) + 0.003 * (k > 0)


def step_seconds(batch: int, k: int, rng: random.Random) -> float:
    return step_cost(batch, k) + 0.0004 * rng.random()


def best_k(batch: int, acceptance: float, k_max: int) -> int:
    """The k with the most tokens per second of modelled time at this batch (every position accepted at
    `acceptance`)."""
    return max(range(k_max + 1), key=lambda k: sum(acceptance ** i for i in range(k + 1)) / step_cost(batch, k))


def regret(batch: int, k: int, accepted: list[int], acceptance: float, best: int) -> float:
    """Modelled time of a step at k beyond what the best k (best_k) takes for the tokens it emitted."""
    per_token = step_cost(batch, best) / sum(acceptance ** i for i in range(best + 1))
    tokens = 1.0 + (sum(accepted) / batch if accepted else 0.0)
    return step_cost(batch, k) - per_token * tokens


def drain(requests: int, rng: random.Random) -> list[int]:
    lengths = sorted(rng.randint(20, 100) for _ in range(requests))
    return [sum(1 for n in lengths if n > t) for t in range(lengths[-1])]


def replay(seed: int, rollouts: int, requests: int, final_acceptance: float, k_max: int, explore_budget: float,
           improves_at: int = 0) -> dict:
    rng = random.Random(seed)
    policy = SpeculationPolicy(k_max=k_max, max_batch=requests, explore_budget=explore_budget)   # as an engine's max_num_seqs
    spent = modelled = explore_regret = choice_regret = after_warmup = 0.0
    steps = at_best = 0
    follows_after = None
    for rollout in range(rollouts):
        policy.on_new_weights()
        acceptance = final_acceptance if rollout >= improves_at else 0.0
        rollout_steps = rollout_at_best = 0
        for batch in drain(requests, rng):
            accepted = []
            explored = policy.explored_steps
            t0 = time.perf_counter()
            k = policy.choose(batch, True)
            spent += time.perf_counter() - t0
            explored = policy.explored_steps > explored
            if k:
                for _ in range(batch):   # accepted drafts are a prefix
                    n = 0
                    while n < k and rng.random() < acceptance:
                        n += 1
                    accepted.append(n)
            seconds = step_seconds(batch, k, rng)
            t0 = time.perf_counter()
            if k:
                policy.acceptance.observe([k] * batch, accepted)
                policy.credit_verified(batch, [k] * batch, accepted)
            policy.cost.observe(batch * (1 + k), batch, k, seconds)
            spent += time.perf_counter() - t0
            modelled += seconds
            steps += 1
            best = best_k(batch, acceptance, k_max)
            at_best += k == best
            rollout_steps += 1
            rollout_at_best += k == best
            if policy.steps > policy.warmup_steps:
                after_warmup += step_cost(batch, k)
                r = regret(batch, k, accepted, acceptance, best)
                if explored:
                    explore_regret += r
                else:
                    choice_regret += r
        if follows_after is None and rollout >= improves_at and rollout_at_best >= 0.5 * rollout_steps:
            follows_after = rollout - improves_at
    return {"rollouts_to_follow": follows_after, "us_per_step": spent / steps * 1e6, "share_of_step": spent / modelled,
            "k_mean": policy.chosen_sum / policy.chosen_count, "k_histogram": list(policy.histogram),
            "steps": steps, "best_k_share": at_best / steps, "explored_share": policy.explored_steps / steps,
            "explore_regret_share": explore_regret / after_warmup, "choice_regret_share": choice_regret / after_warmup}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=40)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--k-max", type=int, default=3)
    ap.add_argument("--acceptance", type=float, nargs="+", default=[0.0, 0.6, 0.95])
    ap.add_argument("--explore-budget", type=float, nargs="+", default=[SpeculationPolicy.explore_budget],
                    help="exploration budgets to replay (trainer.mtp.explore_budget)")
    ap.add_argument("--head-improves-at", type=int, default=0, metavar="R",
                    help="the head is untrained (acceptance 0) before rollout R, then accepted at --acceptance: "
                         "rollouts_to_follow counts the rollouts from R until one ran the best k on half its steps")
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
                     "us_per_step_per_seed": [round(r["us_per_step"], 2) for r in runs],
                     "share_of_step": statistics.median(r["share_of_step"] for r in runs),
                     "k_mean": statistics.mean(r["k_mean"] for r in runs),
                     "k_histogram": [sum(r["k_histogram"][k] for r in runs) for k in range(args.k_max + 1)],
                     "steps": sum(r["steps"] for r in runs),
                     "rollouts_to_follow_per_seed": [r["rollouts_to_follow"] for r in runs],
                     **{key: statistics.mean(r[key] for r in runs)
                        for key in ("best_k_share", "explored_share", "explore_regret_share", "choice_regret_share")}})
    print(f"{'acceptance':>10} {'budget':>7} {'us/step':>9} {'share':>7} {'k_mean':>7} {'at best':>8} {'explored':>9} "
          f"{'explore regret':>15} {'choice regret':>14}  k_histogram")
    for r in rows:
        print(f"{r['acceptance']:>10.2f} {r['explore_budget']:>7.3f} {r['us_per_step']:>9.1f} {r['share_of_step']:>7.2%} "
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
