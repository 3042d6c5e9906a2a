"""The decoupled draft loss of an EAGLE-3 drafter, from one policy forward's captured layer states.

vLLM's EAGLE-3 proposer (vllm/v1/spec_decode/llm_base_proposer.py, ``set_inputs_first_pass``) runs the drafter at
each target position t on: the target's aux hidden states at t concatenated in ascending layer-id order
(``combine_hidden_states`` projects them to H), the token t+1 (the input ids "rotated by one"), and the target's
position t; that pass drafts token t+2, and unroll pass j (drafters/eagle3.py ``unroll``) drafts token t+1+d at
depth d = j+1. That is the MTP head's depth d, so the trained positions, the teacher and the hard target are the
MTP head's (draft_head.compute_draft_loss): positions from ``draft_positions(loss_mask, d, ...)`` (t+1+d a trained
token of t's own segment), the policy's next-token logits at t+d (detached) as the soft target, the sampled token
t+1+d as the hard one, depth d weighted ``depth_decay ** (d - 1)``. The drafter attends over every position of a
row (causally, within a packed segment); only the selected positions enter the loss.

The gradient reaches the drafter only: the captured states, the target's embedding of the input tokens and the
target's output weight (the drafter shares both with the target in vLLM) are all detached.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from skyrl_mtp.mtp.draft_head import (
    DepthSums,
    DraftLossSpec,
    DraftResult,
    depth_weights,
    draft_positions,
    projected_draft_loss,
)
from skyrl_mtp.mtp.layer_capture import CapturedLayerStates


def concat_aux(captured: CapturedLayerStates, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, S, n*H]: the captured [S, B, H] states, detached, concatenated in ascending layer id (vLLM's order)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids.shape={tuple(input_ids.shape)} is invalid: expected [B, S]")
    if not captured.states:
        raise ValueError("captured.states is empty: expected one [S, B, H] state per captured layer")
    b, s = input_ids.shape
    for lid, state in zip(captured.layer_ids, captured.states):
        if state.dim() != 3 or tuple(state.shape[:2]) != (s, b):
            raise ValueError(f"captured state of layer id {lid} has shape {tuple(state.shape)}: expected "
                             f"[S, B, H] = [{s}, {b}, H] (the layout LayerHiddenCapture records)")
    return torch.cat([state.detach().transpose(0, 1) for state in captured.states], dim=-1)


def compute_eagle3_loss(drafter, captured: CapturedLayerStates, policy_logits: torch.Tensor, batch: dict,
                        spec: DraftLossSpec, embed: Callable[[torch.Tensor], torch.Tensor],
                        output_weight: torch.Tensor, vocab_size: int, tp: tuple = (None, 0, 1)) -> DraftResult:
    """Draft loss of depths 1..spec.num_depths (the test-time-training unroll, teacher-forced).

    ``policy_logits`` [B, S, V_local]: the teacher (detached here); ``embed``: ids [B, S] -> the target's embedding
    [B, S, H]; ``output_weight`` [V_local, H]: the target's output layer (its vocab shard); ``tp``: (group, rank,
    size) of tensor parallelism (the vocab shards; the drafter itself is replicated on every TP rank).
    """
    from skyrl_mtp.drafters.eagle3 import unroll
    from skyrl_mtp.mtp.draft_losses import chunk_tokens

    tp_group, tp_rank, tp_size = tp
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    segment_ids = batch.get("segment_ids")
    if tuple(loss_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"loss_mask.shape={tuple(loss_mask.shape)} is invalid: expected the shape of input_ids "
                         f"{tuple(input_ids.shape)}")
    aux = concat_aux(captured, input_ids)
    v_local = policy_logits.shape[-1]
    chunk = chunk_tokens(spec.chunk_size, v_local)
    kwargs = dict(loss_type=spec.loss_type, topk=spec.topk, tp_group=tp_group if tp_size > 1 else None,
                  vocab_start_index=tp_rank * v_local, vocab_size=vocab_size)

    dtype = next(drafter.parameters()).dtype   # the drafter's own (fp32 in training), the logits in the target's

    def detached_embed(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return embed(ids).detach().to(dtype)

    outs = unroll(drafter, aux.to(dtype), input_ids, detached_embed, spec.num_depths,
                  positions=batch.get("position_ids"), segment_ids=segment_ids)
    teacher_all, weight = policy_logits.detach(), output_weight.detach()
    sums = DepthSums()
    for d, (out, w) in enumerate(zip(outs, depth_weights(spec.num_depths, spec.depth_decay)), start=1):
        rows, cols = draft_positions(loss_mask, d, segment_ids, input_ids, spec.position_fraction)
        teacher = teacher_all[rows, cols + d]
        target = input_ids[rows, cols + 1 + d]
        student_hidden = _to_vocab_shards(out.hidden[rows, cols].to(weight.dtype), tp_size)
        sums.add(projected_draft_loss(student_hidden, weight, teacher, target, chunk, **kwargs), w)
    return sums.result()


def _to_vocab_shards(hidden: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Identity forward; under TP the backward sums the hidden state's gradient over the vocab shards (each rank's
    loss sees only its shard's logits), so every rank's replica of the drafter gets the same, whole gradient."""
    if tp_size == 1:
        return hidden
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(hidden)
