"""Assembly of policy-training batches from rollouts: pure tensor code, tested on its own.

A rollout is a prompt, a response and, per response token, whether the policy trains on it
(tool outputs are not). The trainer turns a list of rollouts into the right-padded [B, S] tensors
the policy worker consumes, following the token conventions of the whole project: position t's
logits predict token t+1, so per-token quantities of token t live at index t.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Rollout:
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str
    # 1 where the policy generated the token and trains on it, 0 on tool output; None = all 1.
    response_loss_mask: list[int] | None = None
    group_id: int = 0
    reward: float = 0.0
    info: dict = field(default_factory=dict)

    def policy_mask(self) -> list[int]:
        if self.response_loss_mask is None:
            return [1] * len(self.response_ids)
        if len(self.response_loss_mask) != len(self.response_ids):
            raise ValueError(f"response_loss_mask has {len(self.response_loss_mask)} entries, "
                             f"response_ids has {len(self.response_ids)}: they must match")
        return list(self.response_loss_mask)


def build_train_batch(rollouts: list[Rollout], advantages: torch.Tensor, pad_id: int,
                      response_masks: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Right-padded tensors for the policy worker.

    advantages: [B] per-sequence advantages, broadcast over the sequence's trained tokens.
    response_masks: optional [B] multiplier (0 drops a whole response from the loss, e.g. overlong filtering).
    Returns input_ids, attention_mask, loss_mask, advantages, rollout_logprobs (the engine's logprobs
    of the sampled tokens, for the train/inference mismatch metric), all [B, S].
    """
    if len(rollouts) == 0:
        raise ValueError("build_train_batch got no rollouts")
    if advantages.shape != (len(rollouts),):
        raise ValueError(f"advantages must have shape [{len(rollouts)}], got {tuple(advantages.shape)}")
    seq_len = max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
    bsz = len(rollouts)
    input_ids = torch.full((bsz, seq_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((bsz, seq_len), dtype=torch.long)
    loss_mask = torch.zeros((bsz, seq_len), dtype=torch.float32)
    rollout_logprobs = torch.zeros((bsz, seq_len), dtype=torch.float32)
    for i, r in enumerate(rollouts):
        p, n = len(r.prompt_ids), len(r.response_ids)
        if p == 0:
            raise ValueError(f"rollout {i} has an empty prompt")
        if len(r.response_logprobs) != n:
            raise ValueError(f"rollout {i}: {len(r.response_logprobs)} logprobs for {n} response tokens")
        input_ids[i, :p] = torch.tensor(r.prompt_ids, dtype=torch.long)
        if n:
            input_ids[i, p:p + n] = torch.tensor(r.response_ids, dtype=torch.long)
            loss_mask[i, p:p + n] = torch.tensor(r.policy_mask(), dtype=torch.float32)
            rollout_logprobs[i, p:p + n] = torch.tensor(r.response_logprobs, dtype=torch.float32)
        attention_mask[i, :p + n] = 1
    if response_masks is not None:
        loss_mask = loss_mask * response_masks.to(loss_mask.dtype).view(-1, 1)
    adv = advantages.to(torch.float32).view(-1, 1) * (loss_mask > 0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "advantages": adv,
        "rollout_logprobs": rollout_logprobs,
    }
