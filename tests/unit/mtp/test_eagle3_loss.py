"""compute_eagle3_loss on plain tensors: the captured states line up at t, each unroll depth d is trained at the MTP
head's depth-d positions against the policy's logits at t+d and the sampled token t+1+d, depths weigh
depth_decay ** (d - 1), and the gradient reaches the drafter's parameters and nothing else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from skyrl_mtp.drafters.eagle3 import Eagle3Config, Eagle3Drafter, unroll
from skyrl_mtp.mtp.draft_head import DraftLossSpec, draft_normaliser, draft_positions
from skyrl_mtp.mtp.draft_losses import draft_loss
from skyrl_mtp.mtp.eagle3_loss import compute_eagle3_loss, concat_aux
from skyrl_mtp.mtp.layer_capture import CapturedLayerStates

B, S, H, V = 2, 7, 8, 11


def _cfg() -> Eagle3Config:
    return Eagle3Config(hidden_size=H, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                        rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V, max_position_embeddings=64,
                        target_num_layers=4, aux_layer_ids=(1, 2, 3))


def _batch():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7],
                        [8, 9, 10, 1, 2, 3, 4]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0],     # a prompt of 2, a response of 4, padding
                         [0, 1, 1, 1, 1, 1, 1]])
    return {"input_ids": ids, "loss_mask": mask, "position_ids": torch.arange(S).expand(B, S)}


def _world(seed=0):
    g = torch.Generator().manual_seed(seed)
    captured = CapturedLayerStates((1, 2, 3), tuple(torch.randn(S, B, H, generator=g, requires_grad=True)
                                                    for _ in range(3)))
    embed_w = torch.randn(V, H, generator=g, requires_grad=True)
    out_w = torch.randn(V, H, generator=g, requires_grad=True)
    logits = torch.randn(B, S, V, generator=g, requires_grad=True)
    return captured, embed_w, out_w, logits


def test_captured_states_are_concatenated_at_t_in_layer_order():
    t = torch.arange(S).view(S, 1, 1).float()
    b = torch.arange(B).view(1, B, 1).float()
    cap = CapturedLayerStates((2, 5, 9), tuple(100.0 * k + 10 * b + t + torch.zeros(1, 1, 3) for k in range(3)))
    aux = concat_aux(cap, torch.zeros(B, S, dtype=torch.long))
    assert aux.shape == (B, S, 9)
    assert aux[1, 4].tolist() == [14.0] * 3 + [114.0] * 3 + [214.0] * 3
    with pytest.raises(ValueError, match=r"captured state of layer id 2 has shape \(2, 7, 3\): expected \[S, B, H\]"):
        concat_aux(CapturedLayerStates((2,), (cap.states[0].transpose(0, 1),)), torch.zeros(B, S, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids.shape=\(14,\) is invalid: expected \[B, S\]"):
        concat_aux(cap, torch.zeros(B * S, dtype=torch.long))


@pytest.mark.parametrize("loss_type", ["soft_ce", "hard_ce"])
def test_each_depth_is_the_mtp_heads_positions_teacher_and_target(loss_type):
    captured, embed_w, out_w, logits = _world()
    drafter = Eagle3Drafter(_cfg(), torch.Generator().manual_seed(1))
    batch = _batch()
    spec = DraftLossSpec(loss_type=loss_type, num_depths=2, chunk_size=0)
    res = compute_eagle3_loss(drafter, captured, logits, batch, spec, lambda ids: F.embedding(ids, embed_w), out_w, V)
    assert float(res.num_tokens) == draft_normaliser(batch["loss_mask"], None, batch["input_ids"], spec)
    ids = batch["input_ids"]
    outs = unroll(drafter, concat_aux(captured, ids), ids, embed_w.detach(), 2)
    for d, (out, (loss_sum, n, agree)) in enumerate(zip(outs, res.per_depth), start=1):
        rows, cols = draft_positions(batch["loss_mask"], d, None, ids)
        assert n == rows.numel() > 0
        # depth 1: t = 0..3 of row 0 (token t+2 trained), 0..4 of row 1; depth 2 one fewer each
        assert n == {1: 9, 2: 7}[d]
        want = draft_loss(F.linear(out.hidden[rows, cols], out_w), logits[rows, cols + d], torch.ones_like(rows).bool(),
                          loss_type=loss_type, target_ids=ids[rows, cols + 1 + d], vocab_size=V)
        assert loss_sum == pytest.approx(float(want.loss_sum), rel=1e-5)
        assert agree == float(want.top1_agree)
    res.loss_sum.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    for t in (*captured.states, embed_w, out_w, logits):
        assert t.grad is None


def test_depth_decay_weighs_the_second_depth_and_its_count():
    captured, embed_w, out_w, logits = _world(3)
    drafter = Eagle3Drafter(_cfg(), torch.Generator().manual_seed(1))
    batch = _batch()

    def run(decay):
        spec = DraftLossSpec(num_depths=2, depth_decay=decay, chunk_size=0)
        return compute_eagle3_loss(drafter, captured, logits, batch, spec, lambda ids: F.embedding(ids, embed_w),
                                   out_w, V)

    full, half = run(1.0), run(0.5)
    (l1, n1, _), (l2, n2, _) = full.per_depth
    assert half.per_depth == full.per_depth
    assert float(half.loss_sum) == pytest.approx(l1 + 0.5 * l2, rel=1e-5)
    assert float(half.num_tokens) == n1 + 0.5 * n2


def test_chunked_equals_unchunked():
    captured, embed_w, out_w, logits = _world(5)
    batch = _batch()
    grads = []
    for chunk in (0, 3):
        drafter = Eagle3Drafter(_cfg(), torch.Generator().manual_seed(1))
        spec = DraftLossSpec(num_depths=2, chunk_size=chunk)
        res = compute_eagle3_loss(drafter, captured, logits, batch, spec, lambda ids: F.embedding(ids, embed_w),
                                  out_w, V)
        res.loss_sum.backward()
        grads.append((float(res.loss_sum), [p.grad.clone() for p in drafter.parameters()]))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-5)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
