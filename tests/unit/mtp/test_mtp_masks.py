"""Masks and shifts of the draft loss on hand-built examples (exact tensors)."""

from __future__ import annotations

import pytest
import torch

from skyrl_mtp.mtp.masks import (
    draft_position_mask,
    segment_ids_from_cu_seqlens,
    shift_left,
    teacher_for_depth,
)


def test_shift_left_2d_and_3d():
    x = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    assert torch.equal(shift_left(x, 2, -1), torch.tensor([[3, 4, 5, -1, -1], [8, 9, 10, -1, -1]]))
    assert torch.equal(shift_left(x, 0, -1), x)
    assert torch.equal(shift_left(x, 5, 0), torch.zeros_like(x))
    assert torch.equal(shift_left(x, 9, 0), torch.zeros_like(x))
    y = torch.arange(12.0).reshape(1, 4, 3)
    expected = torch.tensor([[[3.0, 4, 5], [6, 7, 8], [9, 10, 11], [0, 0, 0]]])
    assert torch.equal(shift_left(y, 1, 0.0), expected)


def test_draft_position_mask_unpacked():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]])
    d1 = draft_position_mask(loss_mask, 1)
    assert d1.dtype == torch.bool
    # t valid iff t + 2 < 6 and loss_mask[t + 2] == 1
    assert torch.equal(d1.int(), torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]]))
    d2 = draft_position_mask(loss_mask, 2)
    assert torch.equal(d2.int(), torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]]))


def test_draft_position_mask_packed_never_crosses_segments():
    #                          seg:   0  0  0  0  1  1  1  1 -1
    segment_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, -1]])
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 0]])
    d1 = draft_position_mask(loss_mask, 1, segment_ids)
    # t=0 -> 2 (seg 0, lm 1); t=1 -> 3; t=2 -> 4 other segment; t=3 -> 5 other segment;
    # t=4 -> 6; t=5 -> 7; t=6 -> 8 padding; t=7, t=8 -> past the end
    assert torch.equal(d1.int(), torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0, 0]]))
    without = draft_position_mask(loss_mask, 1)
    assert torch.equal(without.int(), torch.tensor([[1, 1, 0, 1, 1, 1, 0, 0, 0]]))
    d2 = draft_position_mask(loss_mask, 2, segment_ids)
    assert torch.equal(d2.int(), torch.tensor([[1, 0, 0, 0, 1, 0, 0, 0, 0]]))


def test_draft_position_mask_excludes_tool_tokens():
    loss_mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1]])  # positions 3, 4 are tool output
    # t valid iff loss_mask[t + 2] == 1: t = 0 (-> 2), 3 (-> 5), 4 (-> 6); never a tool token as target
    assert torch.equal(draft_position_mask(loss_mask, 1).int(), torch.tensor([[1, 0, 0, 1, 1, 0, 0]]))


def test_teacher_for_depth_is_shifted_and_detached():
    logits = torch.arange(24.0).reshape(1, 4, 6).requires_grad_()
    t = teacher_for_depth(logits, 2)
    assert not t.requires_grad
    assert torch.equal(t[0, :2], logits.detach()[0, 2:])
    assert torch.equal(t[0, 2:], torch.zeros(2, 6))


def test_segment_ids_from_cu_seqlens():
    assert torch.equal(segment_ids_from_cu_seqlens(torch.tensor([0, 3, 5]), 7), torch.tensor([0, 0, 0, 1, 1, -1, -1]))
    assert torch.equal(segment_ids_from_cu_seqlens(torch.tensor([0, 2, 2, 4]), 4), torch.tensor([0, 0, 2, 2]))
    assert torch.equal(segment_ids_from_cu_seqlens(torch.tensor([0]), 3), torch.tensor([-1, -1, -1]))


@pytest.mark.parametrize("call, needle", [
    (lambda: shift_left(torch.zeros(2, 3), -1, 0), "shift=-1"),
    (lambda: draft_position_mask(torch.ones(2, 3), 0), "depth=0"),
    (lambda: draft_position_mask(torch.ones(2, 3), 1, torch.zeros(2, 4)), "segment_ids.shape=(2, 4)"),
    (lambda: teacher_for_depth(torch.zeros(2, 3), 1), "policy_logits.shape=(2, 3)"),
    (lambda: segment_ids_from_cu_seqlens(torch.tensor([1, 3]), 4), "cu_seqlens=[1, 3]"),
    (lambda: segment_ids_from_cu_seqlens(torch.tensor([0, 3, 2]), 4), "non-decreasing"),
    (lambda: segment_ids_from_cu_seqlens(torch.tensor([0, 5]), 4), "total=4"),
])
def test_bad_input_names_the_argument(call, needle):
    with pytest.raises(ValueError) as e:
        call()
    assert needle in str(e.value)
