"""DAPO clipped policy-gradient loss (asymmetric clip, optional dual clip, selectable reduction).

Conventions: all inputs [B, S]; loss_mask 1 on trained response tokens. Loss is to be minimised.
"""

from __future__ import annotations

import torch

LOSS_REDUCTIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def dapo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.28,
    dual_clip_c: float | None = None,
    loss_reduction: str = "token_mean",
    global_num_tokens: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return (loss, metrics).

    per-token loss = -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A); with dual clip (c > 1) the loss of tokens with
    A < 0 is capped at -c*A. Reductions: "token_mean" sums over valid tokens of the batch and divides by their count
    (or by `global_num_tokens` when given); "seq_mean_token_mean" / "seq_mean_token_sum" average per-sequence
    token-means / token-sums over sequences that have at least one valid token.
    `token_weights` ([B, S], no gradient; off_policy.py's corrections): each token's loss is multiplied by its
    weight before the reduction; None leaves the loss as above, operation for operation.
    """
    if eps_clip_low < 0:
        raise ValueError(f"eps_clip_low={eps_clip_low} must be >= 0")
    if eps_clip_high < 0:
        raise ValueError(f"eps_clip_high={eps_clip_high} must be >= 0")
    if dual_clip_c is not None and dual_clip_c <= 1:
        raise ValueError(f"dual_clip_c={dual_clip_c} must be > 1 (or None to disable)")
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction={loss_reduction!r} unknown; allowed: {LOSS_REDUCTIONS}")
    if global_num_tokens is not None and global_num_tokens <= 0:
        raise ValueError(f"global_num_tokens={global_num_tokens} must be > 0")
    shapes = {t.shape for t in (logprobs, old_logprobs, advantages, loss_mask)}
    if len(shapes) != 1:
        raise ValueError(f"logprobs/old_logprobs/advantages/loss_mask shapes differ: {sorted(map(tuple, shapes))}")
    if token_weights is not None and token_weights.shape != logprobs.shape:
        raise ValueError(f"token_weights has shape {tuple(token_weights.shape)}, expected {tuple(logprobs.shape)}")

    mask = loss_mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logprobs.dtype)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_clip_low, 1.0 + eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        capped = torch.minimum(per_token, -adv * dual_clip_c)
        per_token = torch.where(adv < 0, capped, per_token)
    if token_weights is not None:
        per_token = per_token * token_weights.detach().to(per_token.dtype)

    n_valid = mask.sum()
    if loss_reduction == "token_mean":
        denom = torch.as_tensor(global_num_tokens, dtype=mask.dtype) if global_num_tokens else n_valid.clamp(min=1)
        loss = (per_token * mask).sum() / denom
    else:
        seq_tokens = mask.sum(dim=1)
        seq_sum = (per_token * mask).sum(dim=1)
        seq_val = seq_sum / seq_tokens.clamp(min=1) if loss_reduction == "seq_mean_token_mean" else seq_sum
        has = (seq_tokens > 0).to(mask.dtype)
        loss = (seq_val * has).sum() / has.sum().clamp(min=1)

    with torch.no_grad():
        nv = n_valid.clamp(min=1)
        low = ((ratio < 1.0 - eps_clip_low) & (adv < 0)).to(mask.dtype) * mask
        high = ((ratio > 1.0 + eps_clip_high) & (adv > 0)).to(mask.dtype) * mask
        approx_kl = (0.5 * log_ratio.pow(2) * mask).sum() / nv
        metrics = {
            "policy/clip_frac_low": float(low.sum() / nv),
            "policy/clip_frac_high": float(high.sum() / nv),
            "policy/approx_kl": float(approx_kl),
            "policy/ratio_mean": float((ratio * mask).sum() / nv),
        }
        if dual_clip_c is not None:
            dual = ((adv < 0) & (-adv * ratio > -adv * dual_clip_c)).to(mask.dtype) * mask
            metrics["policy/dual_clip_frac"] = float(dual.sum() / nv)
    return loss, metrics
