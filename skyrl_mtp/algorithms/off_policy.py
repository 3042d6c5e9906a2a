"""Off-policy corrections of the DAPO loss: the rollouts were sampled by a behaviour policy (the engine's
weights, one or more versions behind, and vLLM's kernels) that is not the policy the step starts from.

Three logprobs per trained token, all of the sampled token, at index t for token t:
- `logprobs`: the policy being trained (carries the gradient);
- `old_logprobs`: the policy the step starts from, recomputed by the trainer before the update. The PPO ratio
  and its clip are taken against it: in the terms of AReaL's decoupled PPO it is the proximal policy;
- `behaviour_logprobs`: what the engine reported when it sampled the token (the behaviour policy).

Corrections (`algorithm.off_policy.correction`), each a weight on every token's clipped loss, without gradient:
- "none": weight 1, the behaviour logprobs are not read (today's DAPO loss);
- "tis": truncated importance sampling, w = min(pi_old / pi_behaviour, tis_cap); at "token" level per token,
  at "sequence" level one weight per response from the product of its tokens' ratios (sum of log-ratios);
- "decoupled": decoupled PPO (Hilton et al. 2021, AReaL): w = pi_proximal / pi_behaviour, untruncated; with
  `decoupled_weight_cap` the tokens whose weight exceeds the cap get weight 0 (masked, AReaL's
  behav_imp_weight_cap) while still counting in the loss's token count.
When the behaviour logprobs equal the old ones every weight is exactly 1 (exp(0) = 1, min(1, cap) = 1 for a
cap >= 1), and the loss is DAPO's bit for bit.
"""

from __future__ import annotations

import torch

from skyrl_mtp.algorithms.policy_loss import dapo_policy_loss
from skyrl_mtp.allowed import OFF_POLICY_CORRECTIONS, TIS_LEVELS


def check_correction(correction: str, tis_cap: float, tis_level: str, decoupled_weight_cap: float | None) -> None:
    if correction not in OFF_POLICY_CORRECTIONS:
        raise ValueError(f"correction={correction!r} unknown; allowed: {OFF_POLICY_CORRECTIONS}")
    if not tis_cap >= 1.0:
        raise ValueError(f"tis_cap={tis_cap} must be >= 1 (an on-policy token's weight is 1)")
    if tis_level not in TIS_LEVELS:
        raise ValueError(f"tis_level={tis_level!r} unknown; allowed: {TIS_LEVELS}")
    if decoupled_weight_cap is not None and not decoupled_weight_cap > 1.0:
        raise ValueError(f"decoupled_weight_cap={decoupled_weight_cap} must be > 1 or None (no mask)")


def _log_ratio(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (old_logprobs.detach() - behaviour_logprobs.detach().to(old_logprobs.dtype)) * mask


def tis_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, loss_mask: torch.Tensor, *,
                cap: float, level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [B, S], truncated [B, S] bool): min(pi_old / pi_behaviour, cap) per token ("token") or per
    response ("sequence": exp of the sum of the response's trained-token log-ratios, the same on each of its
    tokens). Tokens outside the loss mask (which the loss leaves out) get their unmasked value."""
    mask = loss_mask.to(old_logprobs.dtype)
    log_ratio = _log_ratio(old_logprobs, behaviour_logprobs, mask)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(log_ratio)
    elif level != "token":
        raise ValueError(f"level={level!r} unknown; allowed: {TIS_LEVELS}")
    ratio = torch.exp(log_ratio)
    truncated = (ratio > cap) & (mask > 0)
    return torch.clamp(ratio, max=cap), truncated


def decoupled_weights(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                      *, cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [B, S], masked [B, S] bool): pi_proximal / pi_behaviour per token, 0 where it exceeds `cap`
    (None: no mask); 1 outside the loss mask (which the loss leaves out)."""
    mask = loss_mask.to(proximal_logprobs.dtype)
    ratio = torch.exp(_log_ratio(proximal_logprobs, behaviour_logprobs, mask))
    masked = ((ratio > cap) & (mask > 0)) if cap is not None else torch.zeros_like(mask, dtype=torch.bool)
    return torch.where(masked, torch.zeros_like(ratio), ratio), masked


def corrected_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                          loss_mask: torch.Tensor, *, behaviour_logprobs: torch.Tensor | None = None,
                          off_policy_correction: str = "none", tis_cap: float = 2.0, tis_level: str = "token",
                          decoupled_weight_cap: float | None = None,
                          **dapo_kwargs) -> tuple[torch.Tensor, dict[str, float]]:
    """DAPO's loss (policy_loss.dapo_policy_loss, `dapo_kwargs`) with each token weighted by the correction.

    "none" calls dapo_policy_loss unchanged and ignores `behaviour_logprobs`; the others need them ([B, S]).
    Metrics added: off_policy/weight_mean (mean weight of the trained tokens), off_policy/truncated_frac (tis)
    or off_policy/masked_frac (decoupled with a cap), off_policy/log_ratio_abs_mean (|log pi_old - log
    pi_behaviour| over trained tokens).
    """
    check_correction(off_policy_correction, tis_cap, tis_level, decoupled_weight_cap)
    if off_policy_correction == "none":
        return dapo_policy_loss(logprobs, old_logprobs, advantages, loss_mask, **dapo_kwargs)
    if behaviour_logprobs is None:
        raise ValueError(f"off_policy_correction={off_policy_correction!r} needs behaviour_logprobs (the engine's "
                         "logprobs of the sampled tokens); got None")
    if behaviour_logprobs.shape != logprobs.shape:
        raise ValueError(f"behaviour_logprobs has shape {tuple(behaviour_logprobs.shape)}, expected "
                         f"{tuple(logprobs.shape)}")
    with torch.no_grad():
        if off_policy_correction == "tis":
            weights, flagged = tis_weights(old_logprobs, behaviour_logprobs, loss_mask, cap=tis_cap, level=tis_level)
            flag_name = "off_policy/truncated_frac"
        else:
            weights, flagged = decoupled_weights(old_logprobs, behaviour_logprobs, loss_mask,
                                                 cap=decoupled_weight_cap)
            flag_name = "off_policy/masked_frac"
    loss, metrics = dapo_policy_loss(logprobs, old_logprobs, advantages, loss_mask, token_weights=weights,
                                     **dapo_kwargs)
    with torch.no_grad():
        mask = loss_mask.to(weights.dtype)
        nv = mask.sum().clamp(min=1)
        log_ratio = _log_ratio(old_logprobs, behaviour_logprobs, mask)
        metrics["off_policy/weight_mean"] = float((weights * mask).sum() / nv)
        metrics["off_policy/log_ratio_abs_mean"] = float(log_ratio.abs().sum() / nv)
        if off_policy_correction == "tis" or decoupled_weight_cap is not None:
            metrics[flag_name] = float(flagged.to(mask.dtype).sum() / nv)
    return loss, metrics
