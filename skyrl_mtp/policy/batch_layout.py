"""Per-batch tensors the Megatron forward needs: position ids, attention mask, micro-batch slices.

A batch of one sequence per row needs no mask tensor: its attention is plain causal, which Megatron's layers
apply themselves when the mask is None (every layer spec here builds self-attention with
``attn_mask_type=causal``: the local softmax then builds its [S, S] causal mask, fused_softmax.py
``forward_torch_softmax``, and Transformer Engine's fused/flash attention masks causally in the kernel). Only
packed rows (``segment_ids``: several sequences per row) get the dense [B, 1, S, S] mask, as no causal path
knows their boundaries; at B=64, S=10240 that mask alone is 6.7 GB of host memory (then moved to the device).
"""

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


def packed_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool, True = masked: causal within each segment, nothing across segments."""
    s = segment_ids.shape[1]
    allowed = torch.ones(s, s, dtype=torch.bool).tril()[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return (~allowed).unsqueeze(1)


def prepare(batch: dict) -> dict:
    """Adds position_ids (if absent) and ``megatron_mask``: None (causal, one sequence per row) or, for packed rows,
    the [B, 1, S, S] mask (True = masked)."""
    out = dict(batch)
    ids = batch["input_ids"]
    b, s = ids.shape
    seg = batch.get("segment_ids")
    if "position_ids" not in out:
        out["position_ids"] = segment_positions(seg) if seg is not None else torch.arange(s).expand(b, s).clone()
    out["megatron_mask"] = None if seg is None else packed_mask(seg)
    return out


def layout_bytes(batch: dict) -> int:
    """Host bytes of every tensor of a prepared batch (distinct storages counted once)."""
    seen, total = set(), 0
    for v in batch.values():
        if isinstance(v, torch.Tensor):
            key = v.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += v.untyped_storage().nbytes()
    return total


def micro_batches(batch: dict, size: int):
    b = batch["input_ids"].shape[0]
    for i in range(0, b, size):
        yield {k: (v[i:i + size] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == b else v)
               for k, v in batch.items()}
