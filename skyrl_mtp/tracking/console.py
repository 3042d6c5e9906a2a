"""The one console line a person reads per RL step; every other metric goes to metrics.jsonl / wandb.

    step 3  reward 0.312  eval 0.400  accept 0.62  len 2.24  812 tok/s  21.3 s

A field whose metric the step did not produce is left out (eval only on eval steps, acceptance only
with speculative decoding). The line is written with tqdm.write, which clears and redraws an active
progress bar instead of printing through it.
"""

from __future__ import annotations

import math
from typing import Any, TextIO

from tqdm import tqdm

# (label, metric key, format, unit suffix), in the order they are printed
SPECULATION_FIELDS = ("rollout/train/draft_acceptance_rate", "rollout/train/mean_acceptance_length")
STEP_LINE_FIELDS = (
    ("reward", "reward/mean", ".3f", ""),
    ("eval", "eval/reward/mean", ".3f", ""),
    ("accept", "rollout/train/draft_acceptance_rate", ".2f", ""),
    ("len", "rollout/train/mean_acceptance_length", ".2f", ""),
    ("", "rollout/train/tokens_per_s", ".0f", " tok/s"),
    ("", "timing/step_s", ".1f", " s"),
)


def _fmt(value: Any, spec: str) -> str:
    value = float(value)
    return format(value, spec) if math.isfinite(value) else str(value)


def format_step_line(step: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step}"]
    drafted = bool(metrics.get("rollout/train/num_drafts", 0))   # engines that do not draft report acceptance 0
    for label, key, spec, unit in STEP_LINE_FIELDS:
        if key in SPECULATION_FIELDS and not drafted:
            continue
        value = metrics.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        text = _fmt(value, spec) + unit
        parts.append(f"{label} {text}" if label else text)
    return "  ".join(parts)


def write_line(line: str, stream: TextIO) -> None:
    """Print `line` above any active tqdm bar on the same terminal (the bar is cleared and redrawn)."""
    tqdm.write(line, file=stream)
    stream.flush()
