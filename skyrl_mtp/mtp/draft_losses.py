"""The decoupled draft loss: how far the MTP head's distribution is from the policy's own.

The student is the MTP head's logits at a position, the teacher the policy's (detached) next-token
logits at the position the head predicts. Both arrive as one tensor-parallel vocab shard
[N, V_local]; every reduction over the vocab goes through :mod:`skyrl_mtp.mtp.vocab_parallel`, so
the same code serves TP=1 and TP>1 (empty or all-padding shards included). Columns at or beyond
``vocab_size`` are padding and never take part in a softmax, an arg-max or a top-k.

Loss types (per valid position; summed over positions where ``mask`` is true):
  soft_ce       sum_v -p_v log q_v                       p = softmax(teacher), q = softmax(student)
  hard_ce       -log q[target]                          target = the sampled token (global id)
  topk_soft_ce  sum_{v in K} -p~_v log q_v              K = teacher's global top-k, p~ = p renormalised on K
  tv            1 - sum_v min(p_v, q_v)                 1 - expected acceptance of one draft
``chunked_draft_loss`` computes the student logits from hidden states chunk by chunk, and each chunk's
gradient with them: the gradient reaching the hidden states (and the output weight, if it is trained) is
accumulated in the forward pass and only scaled in backward. So peak memory is O(chunk_size * V_local)
instead of O(N * V_local), and the projection to the vocabulary runs once forward and once for its input
gradient, as in the unchunked loss: no chunk is recomputed (activation checkpointing would project twice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from skyrl_mtp.allowed import MTP_LOSS_CHUNK_AUTO_ELEMENTS, MTP_LOSS_CHUNK_SIZE_ALLOWED, is_chunk_size
from skyrl_mtp.mtp import vocab_parallel as vp

DRAFT_LOSS_TYPES = ("soft_ce", "hard_ce", "topk_soft_ce", "tv")


@dataclass
class DraftLossOutput:
    loss_sum: torch.Tensor  # scalar, differentiable, summed over valid positions
    num_tokens: torch.Tensor  # scalar count of valid positions
    top1_agree: torch.Tensor  # scalar count of valid positions where argmax(student) == argmax(teacher)


def _bad(name: str, value, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is invalid: {allowed}")


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _validate_common(n: int, v_local: int, teacher_logits: torch.Tensor, mask: torch.Tensor, *, loss_type: str,
                     target_ids: torch.Tensor | None, topk: int, vocab_start_index: int,
                     vocab_size: int | None) -> None:
    if loss_type not in DRAFT_LOSS_TYPES:
        raise _bad("loss_type", loss_type, f"expected one of {DRAFT_LOSS_TYPES}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise _bad("topk", topk, "expected an int >= 1")
    if isinstance(vocab_start_index, bool) or not isinstance(vocab_start_index, int) or vocab_start_index < 0:
        raise _bad("vocab_start_index", vocab_start_index, "expected an int >= 0")
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
        raise _bad("vocab_size", vocab_size, "expected None or an int >= 1 (the real, unpadded vocab size)")
    if _shape(teacher_logits) != (n, v_local):
        raise _bad("teacher_logits.shape", _shape(teacher_logits), f"expected {(n, v_local)} (the student's [N, V_local])")
    if not teacher_logits.is_floating_point():
        raise _bad("teacher_logits.dtype", teacher_logits.dtype, "expected a floating dtype")
    if _shape(mask) != (n,):
        raise _bad("mask.shape", _shape(mask), f"expected {(n,)} ([N])")
    if mask.dtype != torch.bool:
        raise _bad("mask.dtype", mask.dtype, "expected torch.bool")
    if target_ids is not None:
        if _shape(target_ids) != (n,):
            raise _bad("target_ids.shape", _shape(target_ids), f"expected {(n,)} ([N])")
        if target_ids.is_floating_point() or target_ids.dtype == torch.bool:
            raise _bad("target_ids.dtype", target_ids.dtype, "expected an integer dtype (global vocab ids)")
    elif loss_type == "hard_ce":
        raise _bad("target_ids", None, "expected a LongTensor [N] of global vocab ids when loss_type='hard_ce'")


def _global_vocab_end(v_local: int, vocab_start_index: int, vocab_size: int | None, group,
                      device: torch.device) -> int:
    if vocab_size is not None:
        return vocab_size
    end = torch.tensor([vocab_start_index + v_local], dtype=torch.long, device=device)
    if group is not None:
        torch.distributed.all_reduce(end, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(end.item())


def _check_targets(target_ids: torch.Tensor, mask: torch.Tensor, vocab_end: int) -> None:
    bad = mask & ((target_ids < 0) | (target_ids >= vocab_end))
    if bool(bad.any()):
        value = int(target_ids[bad][0])
        raise _bad("target_ids", f"contains {value} at a masked position",
                   f"expected global vocab ids in [0, {vocab_end}) wherever mask is true")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _softmax(logits: torch.Tensor, group) -> torch.Tensor:
    """Vocab-parallel softmax of the local shard (differentiable)."""
    lse = vp.replicated_to_local(vp.logsumexp(logits, group), group)
    return (logits - lse.unsqueeze(-1)).exp()


def expected_acceptance(p_logits: torch.Tensor, q_logits: torch.Tensor, *, tp_group=None, vocab_start_index: int = 0,
                        vocab_size: int | None = None) -> torch.Tensor:
    """Per-position probability [N] that a draft sampled from q is accepted by a target p:
    sum_v min(p_v, q_v) over the whole (unpadded) vocab. Differentiable in both arguments."""
    if p_logits.dim() != 2 or _shape(p_logits) != _shape(q_logits):
        raise _bad("q_logits.shape", _shape(q_logits), f"expected 2-D and equal to p_logits.shape {_shape(p_logits)}")
    width = vp.valid_width(p_logits.shape[-1], vocab_start_index, vocab_size)
    dtype = torch.promote_types(_compute_dtype(p_logits), _compute_dtype(q_logits))
    p = _softmax(p_logits[:, :width].to(dtype), tp_group)
    q = _softmax(q_logits[:, :width].to(dtype), tp_group)
    return vp.all_reduce_sum(torch.minimum(p, q).sum(-1), tp_group)


def _per_token_loss(s: torch.Tensor, t: torch.Tensor, loss_type: str, target_ids: torch.Tensor | None, topk: int,
                    group, start: int) -> torch.Tensor:
    """Per-position loss [N] (replicated over TP ranks); ``s``, ``t`` are the valid columns only."""
    if loss_type == "tv":
        p = _softmax(t, group).detach()
        q = _softmax(s, group)
        return 1.0 - vp.all_reduce_sum(torch.minimum(p, q).sum(-1), group)
    lse_s = vp.logsumexp(s, group)
    if loss_type == "soft_ce":
        with torch.no_grad():
            p = _softmax(t, group)
        return lse_s - vp.all_reduce_sum((p * s).sum(-1), group)
    if loss_type == "hard_ce":
        return lse_s - vp.gather_columns(s, target_ids.long().unsqueeze(-1), group, start).squeeze(-1)
    # topk_soft_ce
    vals, ids = vp.topk(t, topk, group, start)
    p_k = torch.softmax(vals, dim=-1)
    s_k = vp.gather_columns(s, ids, group, start)
    return lse_s - (p_k * s_k).sum(-1)


def _masked_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, *, loss_type: str,
                 target_ids: torch.Tensor | None, topk: int, tp_group, vocab_start_index: int,
                 vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, top1_agree) of arguments already validated."""
    width = vp.valid_width(student_logits.shape[-1], vocab_start_index, vocab_size)
    dtype = _compute_dtype(student_logits)
    s = student_logits[:, :width].to(dtype)
    t = teacher_logits.detach()[:, :width].to(dtype)
    per_token = _per_token_loss(s, t, loss_type, target_ids, topk, tp_group, vocab_start_index)
    loss_sum = torch.where(mask, per_token, torch.zeros_like(per_token)).sum()
    with torch.no_grad():
        same = vp.argmax(s, tp_group, vocab_start_index) == vp.argmax(t, tp_group, vocab_start_index)
        top1_agree = (same & mask).sum().to(dtype)
    return loss_sum, top1_agree


def draft_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, *,
               loss_type: str = "soft_ce", target_ids: torch.Tensor | None = None, topk: int = 32, tp_group=None,
               vocab_start_index: int = 0, vocab_size: int | None = None) -> DraftLossOutput:
    """Draft loss of student logits [N, V_local] against detached teacher logits [N, V_local] on one vocab
    shard starting at ``vocab_start_index``; ``mask`` [N] bool selects the positions that count."""
    if student_logits.dim() != 2 or not student_logits.is_floating_point():
        raise _bad("student_logits", f"tensor of shape {_shape(student_logits)} and dtype {student_logits.dtype}",
                   "expected a floating 2-D tensor [N, V_local]")
    n, v_local = student_logits.shape
    _validate_common(n, v_local, teacher_logits, mask, loss_type=loss_type, target_ids=target_ids, topk=topk,
                     vocab_start_index=vocab_start_index, vocab_size=vocab_size)
    if loss_type == "hard_ce":
        _check_targets(target_ids, mask,
                       _global_vocab_end(v_local, vocab_start_index, vocab_size, tp_group, student_logits.device))
    loss_sum, top1_agree = _masked_loss(student_logits, teacher_logits, mask, loss_type=loss_type,
                                        target_ids=target_ids, topk=topk, tp_group=tp_group,
                                        vocab_start_index=vocab_start_index, vocab_size=vocab_size)
    return DraftLossOutput(loss_sum, mask.sum().to(loss_sum.dtype), top1_agree)


def _scaled(grad: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    return grad * grad_loss.to(grad.dtype)


class _ChunkedProjectedLoss(torch.autograd.Function):
    """Sum of ``_masked_loss(hidden @ weight.T, ...)`` over row chunks, its gradient taken chunk by chunk in
    forward: each chunk's logits live only while its loss and their gradient are computed, then the
    gradient is folded into [N, H] (and, if needed, [V_local, H]) and the logits are freed. Under TP every
    rank runs the same chunks, so the loss's collectives (forward and backward) stay in step."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher, mask, target_ids, chunk_size: int, loss_kwargs: dict):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        loss_sum, top1_agree = None, None
        for lo in range(0, max(hidden.shape[0], 1), chunk_size):
            rows = slice(lo, lo + chunk_size)
            h = hidden[rows]
            tgt = None if target_ids is None else target_ids[rows]
            with torch.enable_grad():
                logits = F.linear(h, weight).detach().requires_grad_(want_h or want_w)
                part, agree = _masked_loss(logits, teacher[rows], mask[rows], target_ids=tgt, **loss_kwargs)
            if want_h or want_w:
                g = None
                if part.requires_grad:  # an empty vocab shard's logits may not be used
                    (g,) = torch.autograd.grad(part, logits, allow_unused=True)
                g = torch.zeros_like(logits) if g is None else g
                if want_h:
                    grad_h[rows] = g @ weight
                if want_w:
                    grad_w.addmm_(g.t(), h)
            part = part.detach()
            loss_sum = part if loss_sum is None else loss_sum + part
            top1_agree = agree if top1_agree is None else top1_agree + agree
        ctx.save_for_backward(*(x for x in (grad_h, grad_w) if x is not None))
        ctx.mark_non_differentiable(top1_agree)
        return loss_sum, top1_agree

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_agree):
        saved = iter(ctx.saved_tensors)
        grads = [_scaled(next(saved), grad_loss) if want else None for want in ctx.needs_input_grad[:2]]
        return (*grads, None, None, None, None, None)


def chunk_tokens(chunk_size: int | str, v_local: int) -> int:
    """Tokens per chunk of the draft loss for a chunk-size setting (0: one chunk): an int as given, "auto" as
    many tokens as keep one chunk's logits on a vocab shard of ``v_local`` columns at
    MTP_LOSS_CHUNK_AUTO_ELEMENTS."""
    if not is_chunk_size(chunk_size):
        raise _bad("chunk_size", chunk_size, f"expected {MTP_LOSS_CHUNK_SIZE_ALLOWED}")
    if chunk_size == "auto":
        return max(1, MTP_LOSS_CHUNK_AUTO_ELEMENTS // max(int(v_local), 1))
    return chunk_size


def chunked_draft_loss(student_hidden: torch.Tensor, output_weight: torch.Tensor, teacher_logits: torch.Tensor,
                       mask: torch.Tensor, *, chunk_size: int, loss_type: str = "soft_ce",
                       target_ids: torch.Tensor | None = None, topk: int = 32, tp_group=None,
                       vocab_start_index: int = 0, vocab_size: int | None = None) -> DraftLossOutput:
    """``draft_loss(student_hidden @ output_weight.T, ...)`` with the logits built ``chunk_size`` rows at a
    time and each chunk's gradient taken as it is built (``_ChunkedProjectedLoss``), so no [N, V_local]
    student tensor is ever held and none is rebuilt. Gradient reaches ``student_hidden`` and, only if it
    requires grad, ``output_weight``."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise _bad("chunk_size", chunk_size, "expected an int >= 1")
    if student_hidden.dim() != 2 or not student_hidden.is_floating_point():
        raise _bad("student_hidden", f"tensor of shape {_shape(student_hidden)} and dtype {student_hidden.dtype}",
                   "expected a floating 2-D tensor [N, H]")
    n, h = student_hidden.shape
    if output_weight.dim() != 2 or output_weight.shape[1] != h:
        raise _bad("output_weight.shape", _shape(output_weight), f"expected [V_local, {h}] (H of student_hidden)")
    v_local = output_weight.shape[0]
    _validate_common(n, v_local, teacher_logits, mask, loss_type=loss_type, target_ids=target_ids, topk=topk,
                     vocab_start_index=vocab_start_index, vocab_size=vocab_size)
    if loss_type == "hard_ce":
        _check_targets(target_ids, mask,
                       _global_vocab_end(v_local, vocab_start_index, vocab_size, tp_group, student_hidden.device))
    loss_kwargs = dict(loss_type=loss_type, topk=topk, tp_group=tp_group, vocab_start_index=vocab_start_index,
                       vocab_size=vocab_size)
    loss_sum, top1_agree = _ChunkedProjectedLoss.apply(student_hidden, output_weight, teacher_logits.detach(), mask,
                                                       target_ids, chunk_size, loss_kwargs)
    return DraftLossOutput(loss_sum, mask.sum().to(loss_sum.dtype), top1_agree)
