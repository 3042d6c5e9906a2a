"""The decoupled draft loss of a DFlash drafter, from one policy forward's captured layer states.

vLLM's DFlash proposer (drafters/dflash.py describes it) fills one block per request: the anchor (the token just
sampled, at position a) and block_size - 1 mask slots; slot j drafts the token at a + j, reading the target's states
at the positions before a. The training form (``dflash.block_hidden``) runs many such blocks of one sequence in one
pass. Anchors are positions a >= 1 whose next token a + 1 is a trained (policy) token of a's own segment; each row
trains at most ``max_anchors`` of them, spread evenly over its candidates (deterministic, the same whichever
micro-batch or rank holds the row, so the normaliser counted over the whole batch is what the micro-batches train).
Slot j of an anchor is trained where token a + j is a trained token of the segment: against the policy's
next-token logits at a + j - 1 (detached), the sampled token a + j as the hard target, weighted
``depth_decay ** (j - 1)``; slot j is reported as draft position j (as an MTP head's depth j).

The gradient reaches the drafter only: captured states, the target's embedding and its output layer are detached.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from skyrl_mtp.mtp.draft_head import (
    DepthSums,
    DraftLossSpec,
    DraftResult,
    depth_weights,
    projected_draft_loss,
)
from skyrl_mtp.mtp.eagle3_loss import _to_vocab_shards, concat_aux
from skyrl_mtp.mtp.layer_capture import CapturedLayerStates


def anchor_candidates(loss_mask: torch.Tensor, segment_ids: torch.Tensor | None) -> torch.Tensor:
    """Bool [B, T]: a can anchor a block (1 <= a, token a + 1 trained and in a's segment)."""
    b, t = loss_mask.shape
    out = torch.zeros(b, t, dtype=torch.bool, device=loss_mask.device)
    if t < 3:
        return out
    ok = loss_mask[:, 2:] > 0
    if segment_ids is not None:
        ok = ok & (segment_ids[:, 1:-1] == segment_ids[:, 2:])
    out[:, 1:-1] = ok
    return out


def choose_anchors(loss_mask: torch.Tensor, segment_ids: torch.Tensor | None,
                   max_anchors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [B, N] long, valid [B, N] bool): up to ``max_anchors`` candidates per row, evenly spread; rows with
    fewer are padded with anchor 1, marked invalid."""
    cand = anchor_candidates(loss_mask, segment_ids)
    picks = []
    for row in cand:
        idx = row.nonzero().flatten()
        if idx.numel() > max_anchors:
            idx = idx[torch.linspace(0, idx.numel() - 1, max_anchors, device=idx.device).round().long()]
        picks.append(idx)
    n = max([p.numel() for p in picks] + [1])
    anchors = torch.ones(len(picks), n, dtype=torch.long, device=loss_mask.device)
    valid = torch.zeros(len(picks), n, dtype=torch.bool, device=loss_mask.device)
    for i, p in enumerate(picks):
        anchors[i, :p.numel()], valid[i, :p.numel()] = p, True
    return anchors, valid


def slot_positions(loss_mask: torch.Tensor, segment_ids, anchors: torch.Tensor, valid: torch.Tensor,
                   slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, block index) of the blocks whose slot ``slot`` is trained: token anchor + slot is a trained token of
    the anchor's segment."""
    t = loss_mask.shape[1]
    idx = anchors + slot
    inside = valid & (idx < t)
    at = idx.clamp(max=t - 1)
    ok = inside & (loss_mask.gather(1, at) > 0)
    if segment_ids is not None:
        ok = ok & (segment_ids.gather(1, at) == segment_ids.gather(1, anchors))
    return ok.nonzero(as_tuple=True)


def dflash_normaliser(loss_mask: torch.Tensor, segment_ids, input_ids: torch.Tensor, spec: DraftLossSpec,
                      *, block_size: int, max_anchors: int) -> float:
    """The trained (block, slot) pairs of this batch, each slot counted at its weight."""
    anchors, valid = choose_anchors(loss_mask, segment_ids, max_anchors)
    weights = depth_weights(block_size - 1, spec.depth_decay)
    return sum(w * float(slot_positions(loss_mask, segment_ids, anchors, valid, j)[0].numel())
               for j, w in enumerate(weights, start=1))


def compute_dflash_loss(drafter, captured: CapturedLayerStates, policy_logits: torch.Tensor, batch: dict,
                        spec: DraftLossSpec, embed: Callable[[torch.Tensor], torch.Tensor],
                        output_weight: torch.Tensor, vocab_size: int, *, max_anchors: int,
                        tp: tuple = (None, 0, 1)) -> DraftResult:
    """Draft loss of every slot of the chosen blocks; arguments as eagle3_loss.compute_eagle3_loss, plus
    ``max_anchors`` (blocks per row)."""
    from skyrl_mtp.drafters.dflash import block_hidden
    from skyrl_mtp.mtp.draft_losses import chunk_tokens

    tp_group, tp_rank, tp_size = tp
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    segment_ids = batch.get("segment_ids")
    bs = drafter.cfg.block_size
    aux = concat_aux(captured, input_ids)
    v_local = policy_logits.shape[-1]
    chunk = chunk_tokens(spec.chunk_size, v_local)
    kwargs = dict(loss_type=spec.loss_type, topk=spec.topk, tp_group=tp_group if tp_size > 1 else None,
                  vocab_start_index=tp_rank * v_local, vocab_size=vocab_size)
    dtype = next(drafter.parameters()).dtype

    def detached_embed(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return embed(ids).detach().to(dtype)

    anchors, valid = choose_anchors(loss_mask, segment_ids, max_anchors)
    out = block_hidden(drafter, aux.to(dtype), input_ids, detached_embed, anchors,
                       positions=batch.get("position_ids"), segment_ids=segment_ids)   # [B, N, bs, H]
    teacher_all, weight = policy_logits.detach(), output_weight.detach()
    sums = DepthSums()
    for j, w in enumerate(depth_weights(bs - 1, spec.depth_decay), start=1):
        rows, blocks = slot_positions(loss_mask, segment_ids, anchors, valid, j)
        at = anchors[rows, blocks] + j
        teacher = teacher_all[rows, at - 1]        # the policy's distribution of token a + j
        target = input_ids[rows, at]
        student = _to_vocab_shards(out[rows, blocks, j].to(weight.dtype), tp_size)
        sums.add(projected_draft_loss(student, weight, teacher, target, chunk, **kwargs), w)
    return sums.result()
