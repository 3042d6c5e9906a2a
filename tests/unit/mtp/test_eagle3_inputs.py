"""eagle3_training_inputs on plain tensors: the concatenated aux states at t, the drafter's input token t+1, the
trained positions, the sampled target t+2 and the policy's logits at t+1 as the teacher: the MTP head's depth-1
positions and normaliser exactly, packed segments included."""

from __future__ import annotations

import pytest
import torch

from skyrl_mtp.mtp.draft_head import DraftLossSpec, draft_normaliser
from skyrl_mtp.mtp.eagle3_inputs import eagle3_training_inputs
from skyrl_mtp.mtp.layer_capture import CapturedLayerStates

B, S, H = 2, 7, 3


def _captured(ids=(2, 5, 9)) -> CapturedLayerStates:
    """State k holds 100*k + 10*b + t at [t, b, :] (each entry says where it came from), plus the hidden index / 10."""
    t = torch.arange(S).view(S, 1, 1)
    b = torch.arange(B).view(1, B, 1)
    h = torch.arange(H).view(1, 1, H) / 10
    return CapturedLayerStates(tuple(ids), tuple(100.0 * k + 10 * b + t + h for k in range(len(ids))))


def _batch():
    ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17],
                        [21, 22, 23, 24, 25, 26, 27]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0],     # a prompt of 2, a response of 4, padding
                         [0, 1, 1, 1, 1, 1, 1]])
    return ids, mask


def test_aux_states_tokens_and_targets_line_up_at_t_t1_t2():
    ids, mask = _batch()
    out = eagle3_training_inputs(_captured(), ids, mask)
    assert out.hidden.shape == (B, S, 3 * H)
    for b in range(B):
        for t in range(S):
            want = torch.cat([100.0 * k + 10 * b + t + torch.arange(H) / 10 for k in range(3)])
            assert torch.equal(out.hidden[b, t], want), (b, t)
    assert out.input_ids.tolist() == [[12, 13, 14, 15, 16, 17, 0], [22, 23, 24, 25, 26, 27, 0]]
    # position t trains iff token t+2 is a trained token: row 0 t = 0..3, row 1 t = 0..4
    assert list(zip(out.rows.tolist(), out.cols.tolist())) == [(0, 0), (0, 1), (0, 2), (0, 3),
                                                               (1, 0), (1, 1), (1, 2), (1, 3), (1, 4)]
    assert out.target_ids.tolist() == [13, 14, 15, 16, 23, 24, 25, 26, 27]
    logits = torch.randn(B, S, 11, requires_grad=True)
    teacher = out.teacher_logits(logits)
    assert not teacher.requires_grad and torch.equal(teacher, logits.detach()[out.rows, out.cols + 1])
    assert torch.equal(teacher[4], logits.detach()[1, 1])


def test_positions_and_count_are_the_mtp_heads_depth_1():
    ids = torch.randint(0, 50, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = (torch.rand(3, 20, generator=torch.Generator().manual_seed(1)) > 0.3).long()
    seg = torch.tensor([[0] * 8 + [1] * 12, [0] * 20, [0] * 5 + [1] * 5 + [2] * 6 + [-1] * 4])
    cap = CapturedLayerStates((1,), (torch.zeros(20, 3, 4),))
    for fraction in (1.0, 0.5):
        out = eagle3_training_inputs(cap, ids, mask, seg, position_fraction=fraction)
        spec = DraftLossSpec(num_depths=1, position_fraction=fraction)
        assert out.rows.numel() == draft_normaliser(mask, seg, ids, spec) > 0
        assert bool((seg[out.rows, out.cols] == seg[out.rows, out.cols + 2]).all())   # never across segments
        assert bool((mask[out.rows, out.cols + 2] == 1).all())
    assert out.rows.numel() < eagle3_training_inputs(cap, ids, mask, seg).rows.numel()


@pytest.mark.parametrize("bad, match", [
    ("state", r"captured state of layer id 2 has shape \(2, 7, 3\): expected \[S, B, H\] = \[7, 2, H\]"),
    ("mask", r"loss_mask.shape=\(2, 6\) is invalid: expected the shape of input_ids \(2, 7\)"),
    ("ids", r"input_ids.shape=\(14,\) is invalid: expected \[B, S\]"),
])
def test_mismatched_shapes_are_refused(bad, match):
    ids, mask = _batch()
    cap = _captured()
    if bad == "state":
        cap = CapturedLayerStates((2,), (cap.states[0].transpose(0, 1),))
    elif bad == "mask":
        mask = mask[:, :-1]
    else:
        ids = ids.flatten()
    with pytest.raises(ValueError, match=match):
        eagle3_training_inputs(cap, ids, mask)
