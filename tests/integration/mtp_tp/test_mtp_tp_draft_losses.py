"""TP=2 draft losses equal TP=1 (values, counts and gradients), with real torch.distributed gloo in two
spawned processes, on vocab layouts that include a rank whose shard is empty or all padding."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from mtp_tp_rank import CHUNK, TOPK, run_rank, shard_bounds

from skyrl_mtp.mtp.draft_losses import DRAFT_LOSS_TYPES, chunked_draft_loss, draft_loss, expected_acceptance
from skyrl_mtp.net import free_port

pytestmark = pytest.mark.integration

D = torch.float64
# name: (per-rank shard widths, real vocab size); columns at or beyond the vocab size are padding
LAYOUTS = {
    "even_with_padding": ((4, 4), 7),
    "uneven": ((2, 5), 7),
    "rank1_empty": ((6, 0), 6),
    "rank1_all_padding": ((4, 4), 4),
}
N, H = 9, 5


def _case(shards, vocab_size, seed):
    g = torch.Generator().manual_seed(seed)
    v = sum(shards)
    student = torch.randn(N, v, generator=g, dtype=D) * 2
    teacher = torch.randn(N, v, generator=g, dtype=D) * 2
    student[:, vocab_size:] = 40.0  # padding columns would win every softmax / argmax / top-k if counted
    teacher[:, vocab_size:] = 40.0
    mask = torch.rand(N, generator=g) > 0.25
    mask[:2] = True
    mask[-1] = False
    target = torch.randint(0, vocab_size, (N,), generator=g)
    return dict(shards=shards, vocab_size=vocab_size, student=student, teacher=teacher, mask=mask, target=target,
                hidden=torch.randn(N, H, generator=g, dtype=D), weight=torch.randn(v, H, generator=g, dtype=D))


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtp_tp")
    cases = {name: _case(shards, vs, seed) for seed, (name, (shards, vs)) in enumerate(LAYOUTS.items())}
    cases["rank1_all_padding"]["target"][:] = torch.tensor([3, 0, 1, 2, 3, 3, 0, 1, 2])
    torch.save(cases, tmp / "data.pt")
    mp.spawn(run_rank, args=(2, free_port(), str(tmp / "data.pt"), str(tmp)), nprocs=2, join=True)
    return cases, [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


def _reference(case, loss_type):
    kw = dict(loss_type=loss_type, target_ids=case["target"], topk=TOPK, vocab_size=case["vocab_size"])
    s = case["student"].clone().requires_grad_()
    out = draft_loss(s, case["teacher"], case["mask"], **kw)
    out.loss_sum.backward()
    h = case["hidden"].clone().requires_grad_()
    w = case["weight"].clone().requires_grad_()
    ch = chunked_draft_loss(h, w, case["teacher"], case["mask"], chunk_size=CHUNK, **kw)
    ch.loss_sum.backward()
    return out, s.grad, ch, h.grad, w.grad


def test_layouts_cover_targets_on_one_rank():
    shards, vocab_size = LAYOUTS["rank1_empty"]
    assert shards[1] == 0
    shards, vocab_size = LAYOUTS["rank1_all_padding"]
    assert sum(shards[:1]) >= vocab_size  # every real id, hence every hard_ce target, lives on rank 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("loss_type", DRAFT_LOSS_TYPES)
def test_tp2_equals_tp1(tp_run, layout, loss_type):
    cases, ranks = tp_run
    case = cases[layout]
    out, grad, ch, hidden_grad, weight_grad = _reference(case, loss_type)
    assert 0 < out.num_tokens.item() < N
    hidden_sum = torch.zeros_like(hidden_grad)
    for rank, res in enumerate(ranks):
        r = res[(layout, loss_type)]
        lo, hi = shard_bounds(case["shards"], rank)
        torch.testing.assert_close(r["loss"], out.loss_sum.detach(), rtol=0, atol=1e-12)
        assert r["num"].item() == out.num_tokens.item()
        assert r["agree"].item() == out.top1_agree.item()
        torch.testing.assert_close(r["grad"], grad[:, lo:hi], rtol=0, atol=1e-12)
        torch.testing.assert_close(r["chunked_loss"], ch.loss_sum.detach(), rtol=0, atol=1e-12)
        assert r["chunked_agree"].item() == ch.top1_agree.item()
        torch.testing.assert_close(r["weight_grad"], weight_grad[lo:hi], rtol=0, atol=1e-12)
        hidden_sum += r["hidden_grad"]
    # The hidden state is replicated on TP ranks; Megatron's copy-to-TP-region sums its partial gradients.
    torch.testing.assert_close(hidden_sum, hidden_grad, rtol=0, atol=1e-12)
    if case["shards"][1] == 0 or sum(case["shards"][:1]) >= case["vocab_size"]:
        assert torch.count_nonzero(ranks[1][(layout, loss_type)]["grad"]) == 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tp2_expected_acceptance(tp_run, layout):
    cases, ranks = tp_run
    case = cases[layout]
    ref = expected_acceptance(case["teacher"], case["student"], vocab_size=case["vocab_size"])
    for res in ranks:
        torch.testing.assert_close(res[(layout, "acceptance")], ref, rtol=0, atol=1e-12)
