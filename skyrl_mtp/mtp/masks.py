"""Which positions an MTP head of depth d trains on, and what it is compared with there.

Conventions (all [B, S], right-padded): position t's logits predict token t+1; the MTP head of depth
d (1-based) at position t predicts token t+1+d, and its teacher is the policy's next-token
distribution at position t+d. A position is valid iff t+1+d < S, the predicted token belongs to the
same packed segment as t, and the loss mask is 1 on the predicted token (a response token the policy
trains on; prompt, padding and tool-output tokens are 0). Everything is vectorised: packed rows are
handled by comparing shifted segment ids, never by looping over segments.
"""

from __future__ import annotations

import torch


def _check_depth(depth, name: str = "depth", minimum: int = 1) -> None:
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < minimum:
        raise ValueError(f"{name}={depth!r} is invalid: expected an int >= {minimum}")


def shift_left(x: torch.Tensor, shift: int, fill) -> torch.Tensor:
    """``out[:, t] = x[:, t + shift]`` along dim 1, ``fill`` where ``t + shift >= S``; works for [B, S, ...]."""
    _check_depth(shift, "shift", minimum=0)
    if x.dim() < 2:
        raise ValueError(f"x.shape={tuple(x.shape)} is invalid: expected at least 2 dims [B, S, ...]")
    s = x.shape[1]
    out = torch.full_like(x, fill)
    if shift < s:
        out[:, : s - shift] = x[:, shift:]
    return out


def draft_position_mask(loss_mask: torch.Tensor, depth: int, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [B, S]: true where the depth-``depth`` head's prediction at t (token t+1+depth) trains."""
    _check_depth(depth)
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask.shape={tuple(loss_mask.shape)} is invalid: expected [B, S]")
    shift = 1 + depth
    valid = shift_left(loss_mask, shift, 0) == 1
    if segment_ids is not None:
        if segment_ids.shape != loss_mask.shape:
            raise ValueError(f"segment_ids.shape={tuple(segment_ids.shape)} is invalid: "
                             f"expected the shape of loss_mask {tuple(loss_mask.shape)}")
        ahead = shift_left(segment_ids, shift, -1)
        valid &= (segment_ids == ahead) & (segment_ids >= 0)
    return valid


def teacher_for_depth(policy_logits: torch.Tensor, depth: int) -> torch.Tensor:
    """Detached teacher logits [B, S, V] of the depth-``depth`` head: the policy's logits at t + depth (0 past
    the end, where the mask is false anyway)."""
    _check_depth(depth)
    if policy_logits.dim() != 3:
        raise ValueError(f"policy_logits.shape={tuple(policy_logits.shape)} is invalid: expected [B, S, V]")
    return shift_left(policy_logits.detach(), depth, 0)


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Segment id [total] of each position of a packed row given cumulative lengths ``[0, l0, l0+l1, ...]``;
    positions at or after ``cu_seqlens[-1]`` (padding) get -1. Empty segments are allowed."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens={cu_seqlens.tolist()!r} is invalid: expected a 1-D integer tensor [0, ...]")
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"total={total!r} is invalid: expected an int >= 0")
    cu = cu_seqlens.long()
    if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > total:
        raise ValueError(f"cu_seqlens={cu.tolist()!r} is invalid: expected non-decreasing values starting at 0 "
                         f"and ending at most at total={total}")
    pos = torch.arange(total, device=cu.device)
    ids = torch.searchsorted(cu[1:], pos, right=True)
    return torch.where(pos < cu[-1], ids, torch.full_like(ids, -1))
