"""Stop a run at the first non-finite loss or grad norm, before it can reach a weight sync or a checkpoint.

A NaN in the policy or draft loss (or an infinite grad norm) poisons every later step: the optimizer
step that follows writes NaN into the weights, the engines would be synced with them and the next
checkpoint would save them. The trainer checks each training update's metrics here and stops at once,
naming the metric and the step, so the last complete checkpoint is the last good one.
"""

from __future__ import annotations

import math
from typing import Any

from skyrl_mtp.errors import NonFiniteMetricError


def is_guarded(key: str) -> bool:
    """Losses and grad norms: the metrics whose non-finite value means the update itself is broken."""
    leaf = key.rsplit("/", 1)[-1]
    return "loss" in leaf or "grad_norm" in leaf


def nonfinite_items(metrics: dict[str, Any], guarded_only: bool = False) -> list[tuple[str, float]]:
    """(key, value) of every numeric metric that is NaN or +-inf, sorted by key."""
    out = []
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(float(value)) and (not guarded_only or is_guarded(key)):
            out.append((key, float(value)))
    return sorted(out)


def check_update_metrics(metrics: dict[str, Any], step: int, where: str, last_checkpoint: Any) -> None:
    """Raise NonFiniteMetricError if a loss or grad norm of one training update is not finite."""
    bad = nonfinite_items(metrics, guarded_only=True)
    if not bad:
        return
    names = ", ".join(f"{k}={v}" for k, v in bad)
    raise NonFiniteMetricError(
        f"non-finite {names} at step {step} ({where}); the run stopped before the weight sync and the "
        f"checkpoint of step {step}. The last complete checkpoint is "
        f"{last_checkpoint if last_checkpoint else 'none (no checkpoint written yet)'} and was not modified; "
        "lower the learning rate or check the data, then rerun with trainer.resume=auto to continue from it")
