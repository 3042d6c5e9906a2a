"""Per-batch tensors the Megatron forward needs: position ids, attention mask, micro-batch slices."""

from __future__ import annotations

import torch

# Keys train_step needs, per policy loss: the RL loss needs the rollout's logprobs and the advantages,
# supervised fine-tuning (the warm start) only the tokens and which of them to learn.
REQUIRED_TRAIN_KEYS = {
    "dapo": ("input_ids", "attention_mask", "loss_mask", "old_logprobs", "advantages"),
    "sft": ("input_ids", "attention_mask", "loss_mask"),
}


class BatchError(ValueError):
    """A batch dict is missing keys or has inconsistent shapes."""


def validate_batch(batch: dict, required: tuple[str, ...]) -> None:
    missing = [k for k in required if k not in batch]
    if missing:
        raise BatchError(f"batch is missing keys {missing}; required: {list(required)}")
    shape = tuple(batch["input_ids"].shape)
    if len(shape) != 2:
        raise BatchError(f"batch['input_ids'] must be [B, S], got shape {shape}")
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and tuple(v.shape) != shape:
            raise BatchError(f"batch[{k!r}] has shape {tuple(v.shape)}, expected {shape} like input_ids")


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 at the start of every segment (padding -1 gets 0)."""
    b, s = segment_ids.shape
    idx = torch.arange(s).expand(b, s)
    start = torch.ones_like(segment_ids, dtype=torch.bool)
    start[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    last_start = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return torch.where(segment_ids >= 0, idx - last_start, torch.zeros_like(idx))


def prepare(batch: dict) -> dict:
    """Adds position_ids (if absent) and the Megatron attention mask [B, 1, S, S] (True = masked)."""
    out = dict(batch)
    ids = batch["input_ids"]
    b, s = ids.shape
    seg = batch.get("segment_ids")
    if "position_ids" not in out:
        out["position_ids"] = segment_positions(seg) if seg is not None else torch.arange(s).expand(b, s).clone()
    allowed = torch.ones(s, s, dtype=torch.bool).tril()[None]
    if seg is not None:
        allowed = allowed & (seg[:, :, None] == seg[:, None, :])
    out["megatron_mask"] = (~allowed.expand(b, s, s)).unsqueeze(1)
    return out


def micro_batches(batch: dict, size: int):
    b = batch["input_ids"].shape[0]
    for i in range(0, b, size):
        yield {k: (v[i:i + size] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == b else v)
               for k, v in batch.items()}
