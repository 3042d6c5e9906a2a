"""How many draft depths to train the head on this step when the engines choose k themselves.

Why this exists: under `trainer.mtp.num_speculative_tokens=auto` the engines draft anywhere from 0 to the
maximum k per step. Training every depth up to the maximum costs the head's forward and backward once per
depth even when the engines hardly draft at all, while training only the depths they use would stop the
loop from ever deepening. So the head is trained on the depths the engines drafted in a real share of the
last rollout's steps, plus one more: that next depth improves in the background, the engines' probes
measure it, and speculation deepens once it pays (trainer.mtp.train_depths=null under auto). While
the engines hardly draft at all, the head trains on every few steps only (trainer.mtp.idle_head_train_every):
kept aligned with the policy for when drafting pays again, at a fraction of the cost.

The shares the trainer passes are those of the k each engine's policy chose, not of the k it ran: its
probes, challenges and timing cycles run other ks on a small, steady share of the steps, and counted as
drafting they would keep an engine that has stopped drafting looking busy (and its head training every step).
"""

from __future__ import annotations

MIN_SHARE = 0.1


def engines_idle(k_shares: list[float], min_share: float = MIN_SHARE) -> bool:
    """The engines drafted (k >= 1) in fewer than `min_share` of the steps; no steps recorded: not idle."""
    total = float(sum(k_shares))
    return total > 0 and sum(k_shares[1:]) / total < min_share


def depths_to_train(k_shares: list[float], max_depths: int, min_share: float = MIN_SHARE) -> int:
    """1 + the deepest k drafted at >= `min_share` of the engine steps, within [1, max_depths].

    `k_shares[k]` is the share of engine steps that drafted k tokens (a histogram over 0..k_max, any scale).
    No steps recorded (e.g. the first rollout before any engine step) trains every depth."""
    if max_depths < 1:
        raise ValueError(f"max_depths={max_depths}: the head trains at least depth 1")
    total = float(sum(k_shares))
    if total <= 0:
        return max_depths
    used = [k for k, share in enumerate(k_shares) if share / total >= min_share]
    return max(1, min(max_depths, 1 + max(used, default=0)))
