"""How many draft depths to train the head on this step when the engines choose k themselves, and whether
to train it at all.

Why this exists: under `trainer.mtp.num_speculative_tokens=auto` the engines draft anywhere from 0 to the
maximum k per step. Training every depth up to the maximum costs the head's forward and backward once per
depth even when the engines hardly draft at all, while training only the depths they use would stop the
loop from ever deepening. So the head is trained on the depths the engines drafted in a real share of the
last rollout's steps, plus one more: that next depth improves in the background, the engines' probes
measure it, and speculation deepens once it pays (trainer.mtp.train_depths=null under auto).

Training the head is only worth what its drafts save. Where they save little (a small model whose head
costs as much as a trunk layer, drafting only in a rollout's short tail) training it on every step would
cost more than drafting saves, so the head trains when its credit covers what its last training took
(HeadTrainingCredit; its training and the push of the new head to the engines): the engine time its drafts
saved since it last trained (from the engines' policies), plus an allowance of
`trainer.mtp.idle_head_train_budget` of each step's time for keeping it aligned with the policy for when
drafting pays again. The allowance bounds what keeping an idle head aligned costs, as a share of the run,
on any model: a head that costs a sliver of a large model's step trains on most steps, the tiny default's
(some 60% of its policy update) about every 14th step.

The shares the trainer passes are those of the k each engine's policy chose, not of the k it ran: its
probes, challenges and timing cycles run other ks on a small, steady share of the steps, and counted as
drafting they would make the head train depths the engines do not use.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_SHARE = 0.1


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


@dataclass
class HeadTrainingCredit:
    """Whether the head trains on a step, from what drafting saved, an allowance for keeping it aligned, and
    what training the head costs.

    Each step: `add(saved)` with the engine seconds the engines' verified drafts saved in its rollouts (a
    negative figure counts as 0: exploration's cost is not the head's to repay), `due()`, `trained(s)` after a
    step that trained the head with the seconds the head cost it (its training and pushing it to the
    engines), and `allow(step_seconds)` with the step's time less that, which adds `budget` x it. The credit
    is capped at two trainings' worth, so a long stretch where drafting paid does not keep training a head
    whose drafts stopped paying."""

    budget: float
    credit: float = 0.0
    head_seconds: float | None = None   # the head's training time on the last step that trained it

    def __post_init__(self) -> None:
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 < b <= 1.0:
            raise ValueError(f"budget={b!r} is invalid: a share of the step's time in (0, 1] "
                             "(trainer.mtp.idle_head_train_budget)")

    def add(self, saved_seconds: float) -> None:
        self._bank(max(float(saved_seconds), 0.0))

    def allow(self, step_seconds: float) -> None:
        """The allowance for keeping the head aligned: `budget` of a step's time (its head training aside)."""
        self._bank(self.budget * max(float(step_seconds), 0.0))

    def _bank(self, seconds: float) -> None:
        self.credit += seconds
        if self.head_seconds is not None:
            self.credit = min(self.credit, 2.0 * self.head_seconds)

    def due(self) -> bool:
        """Train on the next step: once the credit covers the head's last training time (any credit while that
        time is unknown)."""
        if self.head_seconds is None:
            return self.credit > 0.0
        return self.credit >= self.head_seconds

    def trained(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"seconds={seconds!r} is invalid: the head's training time, >= 0")
        self.head_seconds = float(seconds)
        self.credit = max(self.credit - self.head_seconds, 0.0)

    def state_dict(self) -> dict[str, float | None]:
        return {"credit": self.credit, "head_seconds": self.head_seconds}

    def load_state_dict(self, state: dict) -> None:
        """What a checkpoint saved, so a resumed run trains the head on the steps an unbroken one would."""
        credit, seconds = state.get("credit"), state.get("head_seconds")
        if not isinstance(credit, (int, float)) or credit < 0 or (
                seconds is not None and (not isinstance(seconds, (int, float)) or seconds < 0)):
            raise ValueError(f"head-training credit state {state!r} is invalid: expected credit >= 0 and "
                             "head_seconds >= 0 or null")
        self.credit, self.head_seconds = float(credit), None if seconds is None else float(seconds)
