"""compute_dflash_loss on plain tensors: anchors are response positions spread evenly and chosen per row alone, slot j
of a block anchored at a is trained where token a + j is, against the policy's logits at a + j - 1 and the sampled
token a + j, slots weigh depth_decay ** (j - 1), the normaliser counts exactly what the loss trains, and the gradient
reaches the drafter's parameters and nothing else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from skyrl_mtp.drafters.dflash import DFlashConfig, DFlashDrafter, block_hidden
from skyrl_mtp.mtp.dflash_loss import (
    anchor_candidates,
    choose_anchors,
    compute_dflash_loss,
    dflash_normaliser,
    slot_positions,
)
from skyrl_mtp.mtp.draft_head import DraftLossSpec
from skyrl_mtp.mtp.draft_losses import draft_loss
from skyrl_mtp.mtp.layer_capture import CapturedLayerStates

B, S, H, V, BS = 2, 9, 8, 11, 3


def _cfg() -> DFlashConfig:
    return DFlashConfig(hidden_size=H, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                        rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V, max_position_embeddings=64,
                        target_num_layers=4, target_layer_ids=(1, 2), num_layers=2, block_size=BS, mask_token_id=V - 1)


def _batch():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9],
                        [8, 9, 7, 1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 0],     # a prompt of 3, a response of 4, padding
                         [0, 1, 1, 1, 1, 1, 1, 1, 1]])
    return {"input_ids": ids, "loss_mask": mask, "position_ids": torch.arange(S).expand(B, S)}


def test_anchors_are_response_positions_spread_evenly_per_row():
    b = _batch()
    cand = anchor_candidates(b["loss_mask"], None)
    assert cand[0].nonzero().flatten().tolist() == [2, 3, 4, 5]          # token a + 1 in the response
    assert cand[1].nonzero().flatten().tolist() == [1, 2, 3, 4, 5, 6, 7]  # never a = 0 (no context) or the last
    anchors, valid = choose_anchors(b["loss_mask"], None, 3)
    assert anchors.tolist() == [[2, 4, 5], [1, 4, 7]] and valid.all()
    alone, _ = choose_anchors(b["loss_mask"][1:], None, 3)
    assert alone.tolist() == [[1, 4, 7]]                                  # a row's anchors do not depend on the batch
    few, ok = choose_anchors(b["loss_mask"], None, 5)
    assert few[0].tolist() == [2, 3, 4, 5, 1] and ok[0].tolist() == [True] * 4 + [False]
    seg = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1]] * 2)
    assert 3 not in anchor_candidates(b["loss_mask"], seg)[0].nonzero().flatten().tolist()   # a + 1 in another segment


@pytest.mark.parametrize("loss_type", ["soft_ce", "hard_ce"])
def test_each_slot_is_trained_against_the_policy_at_a_plus_j_minus_1(loss_type):
    g = torch.Generator().manual_seed(0)
    captured = CapturedLayerStates((2, 3), tuple(torch.randn(S, B, H, generator=g, requires_grad=True)
                                                 for _ in range(2)))
    embed_w = torch.randn(V, H, generator=g, requires_grad=True)
    out_w = torch.randn(V, H, generator=g, requires_grad=True)
    logits = torch.randn(B, S, V, generator=g, requires_grad=True)
    drafter = DFlashDrafter(_cfg(), torch.Generator().manual_seed(1))
    b = _batch()
    spec = DraftLossSpec(loss_type=loss_type, chunk_size=0)
    res = compute_dflash_loss(drafter, captured, logits, b, spec, lambda ids: F.embedding(ids, embed_w), out_w, V,
                              max_anchors=3)
    assert float(res.num_tokens) == dflash_normaliser(b["loss_mask"], None, b["input_ids"], spec, block_size=BS,
                                                      max_anchors=3)
    anchors, valid = choose_anchors(b["loss_mask"], None, 3)
    aux = torch.cat([s.detach().transpose(0, 1) for s in captured.states], -1)
    out = block_hidden(drafter, aux, b["input_ids"], embed_w.detach(), anchors)
    assert len(res.per_depth) == BS - 1
    for j, (loss_sum, n, agree) in enumerate(res.per_depth, start=1):
        rows, blocks = slot_positions(b["loss_mask"], None, anchors, valid, j)
        at = anchors[rows, blocks] + j
        assert bool((b["loss_mask"][rows, at] == 1).all()) and n == rows.numel() > 0
        want = draft_loss(F.linear(out[rows, blocks, j], out_w), logits[rows, at - 1], torch.ones_like(rows).bool(),
                          loss_type=loss_type, target_ids=b["input_ids"][rows, at], vocab_size=V)
        assert loss_sum == pytest.approx(float(want.loss_sum), rel=1e-5) and agree == float(want.top1_agree)
    # row 0's anchors 2, 4, 5: slot 1 -> tokens 3, 5, 6, slot 2 -> 4, 6 (7 is padding); row 1's 1, 4, 7: slot 1 ->
    # 2, 5, 8, slot 2 -> 3, 6 (9 is past the end)
    assert [d[1] for d in res.per_depth] == [6.0, 4.0]
    res.loss_sum.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    for t in (*captured.states, embed_w, out_w, logits):
        assert t.grad is None


def test_slot_decay_weighs_the_second_slot_and_its_count():
    g = torch.Generator().manual_seed(3)
    captured = CapturedLayerStates((2, 3), tuple(torch.randn(S, B, H, generator=g) for _ in range(2)))
    embed_w, out_w, logits = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g), torch.randn(B, S, V, generator=g)
    drafter = DFlashDrafter(_cfg(), torch.Generator().manual_seed(1))
    b = _batch()

    def run(decay):
        spec = DraftLossSpec(depth_decay=decay, chunk_size=0)
        return compute_dflash_loss(drafter, captured, logits, b, spec, lambda ids: F.embedding(ids, embed_w), out_w, V,
                                   max_anchors=4), spec

    (full, _), (half, spec) = run(1.0), run(0.5)
    (l1, n1, _), (l2, n2, _) = full.per_depth
    assert half.per_depth == full.per_depth
    assert float(half.loss_sum) == pytest.approx(l1 + 0.5 * l2, rel=1e-5)
    assert float(half.num_tokens) == n1 + 0.5 * n2 == dflash_normaliser(b["loss_mask"], None, b["input_ids"], spec,
                                                                        block_size=BS, max_anchors=4)
