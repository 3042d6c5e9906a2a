"""DAPO overlong handling: mask truncated responses out of the loss, or penalise length softly."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def overlong_filter_mask(finish_reasons: Sequence[str] | torch.Tensor) -> torch.Tensor:
    """Float [B] multiplier: 0 for truncated responses (finish_reason "length" or truncated=True), else 1."""
    if isinstance(finish_reasons, torch.Tensor):
        return (~finish_reasons.bool()).float()
    allowed = ("stop", "length", "abort")
    for i, r in enumerate(finish_reasons):
        if r not in allowed:
            raise ValueError(f"finish_reasons[{i}]={r!r}; allowed: {allowed}")
    return torch.tensor([0.0 if r == "length" else 1.0 for r in finish_reasons])


def soft_overlong_penalty(
    response_lengths: torch.Tensor, max_response_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO penalty (<= 0): 0 for L <= max-buffer, -(L-(max-buffer))/buffer*factor inside the buffer, -factor beyond max."""
    if max_response_len <= 0:
        raise ValueError(f"max_response_len={max_response_len} must be > 0")
    if not 0 < buffer_len <= max_response_len:
        raise ValueError(f"buffer_len={buffer_len} must be in (0, max_response_len={max_response_len}]")
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor={penalty_factor} must be >= 0")
    lengths = response_lengths.float()
    expected = max_response_len - buffer_len
    pen = -(lengths - expected).clamp(min=0) / buffer_len * penalty_factor
    return pen.clamp(min=-penalty_factor)
