"""GRPO group-relative advantages: each response is scored against the other responses to the same prompt."""

from __future__ import annotations

import torch


def _safe(denom: torch.Tensor) -> torch.Tensor:
    # all-equal groups have a zero numerator; avoid 0/0 when eps == 0
    return torch.where(denom == 0, torch.ones_like(denom), denom)


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sequence advantages (r - mean_group) [/ (std_group + eps)].

    `rewards` is [N] with `group_ids` [N] (any integer labels), or [num_groups, n] (group_ids ignored,
    output has the same shape). std is the unbiased sample std; a group of one gets std 0 -> advantage 0.
    """
    if eps < 0:
        raise ValueError(f"eps={eps} must be >= 0")
    if rewards.dim() == 2:
        r = rewards.float()
        mean = r.mean(dim=1, keepdim=True)
        adv = r - mean
        if norm_by_std:
            std = r.std(dim=1, keepdim=True) if r.shape[1] > 1 else torch.zeros_like(mean)
            adv = adv / _safe(std + eps)
        return adv
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N] or 2-D [groups, n], got shape {tuple(rewards.shape)}")
    if group_ids is None:
        raise ValueError("group_ids is required when rewards is 1-D")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids shape {tuple(group_ids.shape)} != rewards shape {tuple(rewards.shape)}")
    r = rewards.float()
    adv = torch.zeros_like(r)
    for g in torch.unique(group_ids):
        sel = group_ids == g
        rg = r[sel]
        a = rg - rg.mean()
        if norm_by_std:
            std = rg.std() if rg.numel() > 1 else torch.zeros((), dtype=r.dtype)
            a = a / _safe(std + eps)
        adv[sel] = a
    return adv


def broadcast_to_tokens(seq_advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B] per-sequence advantages -> [B, S] token advantages, zero where loss_mask is 0."""
    if seq_advantages.dim() != 1 or seq_advantages.shape[0] != loss_mask.shape[0]:
        raise ValueError(
            f"seq_advantages shape {tuple(seq_advantages.shape)} must be [B] with B={loss_mask.shape[0]}"
        )
    return seq_advantages.float()[:, None] * loss_mask.float()
