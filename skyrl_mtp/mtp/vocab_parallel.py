"""Reductions over a vocabulary split across tensor-parallel ranks.

Under tensor parallelism each rank holds the logits of one contiguous vocab shard
``[vocab_start_index, vocab_start_index + V_local)``; a shard may be partly or wholly padding
(columns at or beyond the real vocab size) or even empty (``V_local == 0``). The draft losses
need softmax normalisers, arg-maxes, top-k and gathers over the WHOLE vocab, so every such
reduction lives here, works with ``group=None`` (one rank, no collectives) and makes every rank,
empty shard or not, take part in the same collectives in the same order.

Autograd convention (Megatron's for vocab-parallel losses): a reduced value is REPLICATED on every
rank and every rank back-propagates the same replicated loss, so the gradient of a rank's local
input is the derivative of that one loss, and the backward of a summing all-reduce is the identity.
A reduced value that then feeds rank-local terms (e.g. a softmax normaliser applied to the shard)
must pass through :func:`replicated_to_local`, whose backward sums the partial gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_NO_INDEX = torch.iinfo(torch.long).max


def valid_width(v_local: int, vocab_start_index: int, vocab_size: int | None) -> int:
    """How many of the shard's leading columns are real vocab entries (the rest is padding)."""
    if vocab_size is None:
        return v_local
    return max(0, min(v_local, vocab_size - vocab_start_index))


def world_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _AllReduceSumReplicated(torch.autograd.Function):
    """Sum over ranks whose result is used identically on every rank: backward is the identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable sum over the TP group (identity when ``group`` is None)."""
    if group is None:
        return x
    return _AllReduceSumReplicated.apply(x, group)


class _ReplicatedToLocal(torch.autograd.Function):
    """Marks a replicated value as feeding rank-local terms: forward identity, backward sums the gradients
    (each rank's local terms contribute a part of the replicated value's total gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def replicated_to_local(x: torch.Tensor, group) -> torch.Tensor:
    """Use before combining a replicated value with the rank's own shard (identity when ``group`` is None)."""
    if group is None:
        return x
    return _ReplicatedToLocal.apply(x, group)


def _all_reduce_(x: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


def _global_logsumexp(x: torch.Tensor, group) -> torch.Tensor:
    """Row-wise logsumexp over all ranks' columns, no autograd; an empty shard contributes nothing."""
    local = torch.logsumexp(x, dim=-1) if x.shape[-1] > 0 else x.new_full(x.shape[:-1], float("-inf"))
    if group is None:
        return local
    top = _all_reduce_(local.clone(), dist.ReduceOp.MAX, group)
    shifted = torch.where(torch.isneginf(local), torch.zeros_like(local), (local - top).exp())
    return _all_reduce_(shifted, dist.ReduceOp.SUM, group).log() + top


class _VocabParallelLogSumExp(torch.autograd.Function):
    """Saves only the input (already held by the caller) and the [N] result; backward recomputes softmax."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        lse = _global_logsumexp(x, group)
        ctx.save_for_backward(x, lse)
        return lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, lse = ctx.saved_tensors
        return (x - lse.unsqueeze(-1)).exp_().mul_(grad.unsqueeze(-1)), None


def logsumexp(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable row-wise logsumexp over the whole vocab of ``x`` [N, V_local] -> [N] (replicated)."""
    return _VocabParallelLogSumExp.apply(x, group)


@torch.no_grad()
def argmax(x: torch.Tensor, group, vocab_start_index: int) -> torch.Tensor:
    """Global vocab id [N] of each row's maximum; ties go to the smallest id, as torch.argmax does."""
    n = x.shape[0]
    if x.shape[-1] > 0:
        best, idx = x.max(dim=-1)
        idx = idx + vocab_start_index
    else:
        best = x.new_full((n,), float("-inf"))
        idx = torch.full((n,), _NO_INDEX, dtype=torch.long, device=x.device)
    if group is None:
        return idx
    top = _all_reduce_(best.clone(), dist.ReduceOp.MAX, group)
    mine = torch.where(best == top, idx, torch.full_like(idx, _NO_INDEX))
    return _all_reduce_(mine, dist.ReduceOp.MIN, group)


@torch.no_grad()
def topk(x: torch.Tensor, k: int, group, vocab_start_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k over the vocab: values [N, k] and global ids [N, k] (id -1 / value -inf where the
    vocab has fewer than k entries). Each rank contributes only its own k candidates."""
    n, width = x.shape
    kk = min(k, width)
    vals = x.new_full((n, k), float("-inf"))
    ids = torch.full((n, k), -1, dtype=torch.long, device=x.device)
    if kk > 0:
        v, i = x.topk(kk, dim=-1)
        vals[:, :kk] = v
        ids[:, :kk] = i + vocab_start_index
    if group is None:
        return vals, ids
    ws = world_size(group)
    all_vals = [torch.empty_like(vals) for _ in range(ws)]
    all_ids = [torch.empty_like(ids) for _ in range(ws)]
    dist.all_gather(all_vals, vals, group=group)
    dist.all_gather(all_ids, ids, group=group)
    cand_vals, cand_ids = torch.cat(all_vals, dim=-1), torch.cat(all_ids, dim=-1)
    best_vals, pos = cand_vals.topk(k, dim=-1)
    return best_vals, cand_ids.gather(-1, pos)


def gather_columns(x: torch.Tensor, global_ids: torch.Tensor, group, vocab_start_index: int) -> torch.Tensor:
    """Differentiable ``x_global[n, global_ids[n, j]]`` [N, J] (replicated); ids outside the vocab give 0."""
    width = x.shape[-1]
    local = global_ids - vocab_start_index
    mine = (local >= 0) & (local < width)
    if width > 0:
        picked = x.gather(-1, local.clamp(0, width - 1))
        picked = torch.where(mine, picked, torch.zeros_like(picked))
    else:
        picked = x.new_zeros(global_ids.shape)
    return all_reduce_sum(picked, group)
