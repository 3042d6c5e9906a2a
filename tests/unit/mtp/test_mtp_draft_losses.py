"""The draft-loss math on plain tensors (TP=1): values against naive formulas, gradients (float64
gradcheck), top-k, padding, chunking, packing, expected acceptance and bad input."""

from __future__ import annotations

import pytest
import torch

from skyrl_mtp.mtp.draft_losses import DRAFT_LOSS_TYPES, chunked_draft_loss, draft_loss, expected_acceptance
from skyrl_mtp.mtp.masks import draft_position_mask, shift_left, teacher_for_depth

D = torch.float64


def _data(n=6, v=7, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(n, v, generator=g, dtype=D) * scale)
    t = (torch.randn(n, v, generator=g, dtype=D) * scale)
    mask = torch.rand(n, generator=g) > 0.3
    mask[0] = True
    target = torch.randint(0, v, (n,), generator=g)
    return s, t, mask, target


def _naive_per_token(s, t, loss_type, target, topk):
    p, logq = t.softmax(-1), s.log_softmax(-1)
    if loss_type == "soft_ce":
        return -(p * logq).sum(-1)
    if loss_type == "hard_ce":
        return -logq.gather(-1, target[:, None])[:, 0]
    if loss_type == "tv":
        return 1 - torch.minimum(p, s.softmax(-1)).sum(-1)
    k = min(topk, s.shape[-1])
    vals, idx = t.topk(k, -1)
    return -(vals.softmax(-1) * logq.gather(-1, idx)).sum(-1)


@pytest.mark.parametrize("loss_type", DRAFT_LOSS_TYPES)
def test_values_match_naive_formulas(loss_type):
    s, t, mask, target = _data()
    out = draft_loss(s, t, mask, loss_type=loss_type, target_ids=target, topk=3)
    expected = (_naive_per_token(s, t, loss_type, target, 3) * mask).sum()
    torch.testing.assert_close(out.loss_sum, expected, rtol=0, atol=1e-12)
    assert out.num_tokens.item() == mask.sum().item()
    agree = ((s.argmax(-1) == t.argmax(-1)) & mask).sum().item()
    assert out.top1_agree.item() == agree
    assert not out.top1_agree.requires_grad and out.loss_sum.requires_grad is False  # inputs need no grad


def test_top1_agree_hand_built():
    s = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    t = torch.tensor([[0.0, 2.0, 1.0], [0.0, 3.0, 1.0], [0.0, 0.0, 9.0]])
    out = draft_loss(s, t, torch.tensor([True, True, False]))
    assert out.top1_agree.item() == 1.0 and out.num_tokens.item() == 2.0


def test_soft_ce_gradient_is_q_minus_p_times_mask():
    s, t, mask, _ = _data(n=9, v=11, seed=1)
    s.requires_grad_()
    draft_loss(s, t, mask).loss_sum.backward()
    expected = (s.detach().softmax(-1) - t.softmax(-1)) * mask[:, None]
    torch.testing.assert_close(s.grad, expected, rtol=0, atol=1e-13)


@pytest.mark.parametrize("loss_type", DRAFT_LOSS_TYPES)
@pytest.mark.parametrize("vocab_size", [None, 5])
def test_gradcheck_float64(loss_type, vocab_size):
    s, t, mask, target = _data(n=5, v=7, seed=2)
    if vocab_size is not None:
        target = target % vocab_size
    s.requires_grad_()

    def f(x):
        return draft_loss(x, t, mask, loss_type=loss_type, target_ids=target, topk=3, vocab_size=vocab_size).loss_sum

    assert torch.autograd.gradcheck(f, (s,), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("loss_type", DRAFT_LOSS_TYPES)
def test_gradcheck_chunked_wrt_hidden_and_weight(loss_type):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(5, 4, generator=g, dtype=D, requires_grad=True)
    w = torch.randn(6, 4, generator=g, dtype=D, requires_grad=True)
    _, t, mask, target = _data(n=5, v=6, seed=3)

    def f(hh, ww):
        return chunked_draft_loss(hh, ww, t, mask, chunk_size=2, loss_type=loss_type, target_ids=target,
                                  topk=2).loss_sum

    assert torch.autograd.gradcheck(f, (h, w), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("k", [7, 8, 100])
def test_topk_equals_soft_ce_when_k_covers_vocab(k):
    s, t, mask, _ = _data(v=7, seed=4)
    s1 = s.clone().requires_grad_()
    s2 = s.clone().requires_grad_()
    a = draft_loss(s1, t, mask, loss_type="soft_ce")
    b = draft_loss(s2, t, mask, loss_type="topk_soft_ce", topk=k)
    a.loss_sum.backward()
    b.loss_sum.backward()
    torch.testing.assert_close(a.loss_sum, b.loss_sum, rtol=0, atol=1e-12)
    torch.testing.assert_close(s1.grad, s2.grad, rtol=0, atol=1e-12)


def test_topk_smaller_k_differs_from_exact():
    s, t, mask, _ = _data(v=7, seed=4)
    a = draft_loss(s, t, mask, loss_type="soft_ce").loss_sum
    b = draft_loss(s, t, mask, loss_type="topk_soft_ce", topk=2).loss_sum
    assert abs(float(a - b)) > 1e-3


@pytest.mark.parametrize("loss_type", DRAFT_LOSS_TYPES)
def test_padding_columns_are_ignored(loss_type):
    s, t, mask, target = _data(v=5, seed=5)
    pad = torch.full((s.shape[0], 3), 50.0, dtype=D)  # huge logits: would dominate softmax / argmax / top-k
    sp = torch.cat([s, pad], -1).requires_grad_()
    tp = torch.cat([t, pad], -1)
    s1 = s.clone().requires_grad_()
    ref = draft_loss(s1, t, mask, loss_type=loss_type, target_ids=target, topk=2)
    got = draft_loss(sp, tp, mask, loss_type=loss_type, target_ids=target, topk=2, vocab_size=5)
    ref.loss_sum.backward()
    got.loss_sum.backward()
    torch.testing.assert_close(got.loss_sum, ref.loss_sum, rtol=0, atol=1e-12)
    assert got.top1_agree.item() == ref.top1_agree.item()
    torch.testing.assert_close(sp.grad[:, :5], s1.grad, rtol=0, atol=1e-12)
    assert torch.count_nonzero(sp.grad[:, 5:]) == 0


def test_tv_is_one_minus_expected_acceptance():
    s, t, mask, _ = _data(seed=6)
    acc = expected_acceptance(t, s)
    got = draft_loss(s, t, mask, loss_type="tv").loss_sum
    torch.testing.assert_close(got, ((1 - acc) * mask).sum(), rtol=0, atol=1e-12)
    torch.testing.assert_close(acc, torch.minimum(t.softmax(-1), s.softmax(-1)).sum(-1), rtol=0, atol=1e-12)
    torch.testing.assert_close(expected_acceptance(t, t), torch.ones(t.shape[0], dtype=D), rtol=0, atol=1e-12)
    disjoint_p = torch.tensor([[30.0, -30.0]], dtype=D)
    disjoint_q = torch.tensor([[-30.0, 30.0]], dtype=D)
    assert float(expected_acceptance(disjoint_p, disjoint_q)) < 1e-20


def test_masked_positions_get_no_gradient():
    s, t, mask, _ = _data(seed=7)
    for lt in DRAFT_LOSS_TYPES:
        x = s.clone().requires_grad_()
        draft_loss(x, t, mask, loss_type=lt, target_ids=torch.zeros(6, dtype=torch.long)).loss_sum.backward()
        assert torch.count_nonzero(x.grad[~mask]) == 0
        assert torch.count_nonzero(x.grad[mask]) > 0


def test_teacher_gets_no_gradient():
    s, t, mask, _ = _data(seed=8)
    t = t.clone().requires_grad_()
    for lt in DRAFT_LOSS_TYPES:
        out = draft_loss(s.clone().requires_grad_(), t, mask, loss_type=lt, target_ids=torch.zeros(6, dtype=torch.long))
        out.loss_sum.backward()
    assert t.grad is None


@pytest.mark.parametrize("loss_type", DRAFT_LOSS_TYPES)
@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_chunked_equals_unchunked(loss_type, chunk_size):
    g = torch.Generator().manual_seed(9)
    n, h, v = 13, 8, 10
    hidden = torch.randn(n, h, generator=g, dtype=D)
    weight = torch.randn(v, h, generator=g, dtype=D)
    _, t, mask, target = _data(n=n, v=v, seed=9)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    kw = dict(loss_type=loss_type, target_ids=target % 9, topk=3, vocab_size=9)
    ref = draft_loss(h1 @ w1.t(), t, mask, **kw)
    got = chunked_draft_loss(h2, w2, t, mask, chunk_size=chunk_size, **kw)
    ref.loss_sum.backward()
    got.loss_sum.backward()
    torch.testing.assert_close(got.loss_sum, ref.loss_sum, rtol=0, atol=1e-11)
    assert got.top1_agree.item() == ref.top1_agree.item() and got.num_tokens.item() == ref.num_tokens.item()
    torch.testing.assert_close(h2.grad, h1.grad, rtol=0, atol=1e-11)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=0, atol=1e-11)


def test_chunked_weight_grad_only_if_required():
    g = torch.Generator().manual_seed(10)
    hidden = torch.randn(7, 4, generator=g, dtype=D, requires_grad=True)
    weight = torch.randn(6, 4, generator=g, dtype=D)
    _, t, mask, _ = _data(n=7, v=6, seed=10)
    chunked_draft_loss(hidden, weight, t, mask, chunk_size=3).loss_sum.backward()
    assert weight.grad is None
    expected = ((hidden.detach() @ weight.t()).softmax(-1) - t.softmax(-1)) * mask[:, None] @ weight
    torch.testing.assert_close(hidden.grad, expected, rtol=0, atol=1e-12)


def _max_saved_numel(fn) -> int:
    sizes = [0]

    def pack(x):
        sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return max(sizes)


@pytest.mark.parametrize("loss_type", DRAFT_LOSS_TYPES)
def test_chunked_keeps_no_full_logits_for_backward(loss_type):
    n, h, v, chunk = 256, 16, 300, 32
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h)
    t = torch.randn(n, v)
    mask = torch.ones(n, dtype=torch.bool)
    kw = dict(loss_type=loss_type, target_ids=torch.zeros(n, dtype=torch.long), topk=4)
    full = _max_saved_numel(lambda: draft_loss(hidden @ weight.t(), t, mask, **kw))
    chunked = _max_saved_numel(lambda: chunked_draft_loss(hidden, weight, t, mask, chunk_size=chunk, **kw))
    assert full >= n * v
    assert chunked <= max(n * h, v * h, chunk * v)


@pytest.mark.parametrize("loss_type", DRAFT_LOSS_TYPES)
@pytest.mark.parametrize("depth", [1, 2])
def test_packed_equals_unpacked(loss_type, depth):
    g = torch.Generator().manual_seed(11)
    v, lens = 9, (7, 5)
    seqs = [torch.randint(0, v, (n,), generator=g) for n in lens]
    students = [torch.randn(n, v, generator=g, dtype=D) for n in lens]
    policies = [torch.randn(n, v, generator=g, dtype=D) for n in lens]
    lmasks = [torch.tensor([0, 0, 1, 1, 1, 1, 1]), torch.tensor([0, 1, 1, 1, 1])]
    kw = dict(loss_type=loss_type, topk=3)

    def one(ids, student, policy, lm, seg):
        b = ids[None]
        mask = draft_position_mask(lm[None], depth, None if seg is None else seg[None]).reshape(-1)
        teacher = teacher_for_depth(policy[None], depth).reshape(-1, v)
        target = shift_left(b, 1 + depth, 0).reshape(-1)
        return draft_loss(student, teacher, mask, target_ids=target, **kw)

    separate = [one(*args, None) for args in zip(seqs, students, policies, lmasks)]
    pad = 3
    seg = torch.tensor([0] * lens[0] + [1] * lens[1] + [-1] * pad)
    packed = one(torch.cat(seqs + [torch.zeros(pad, dtype=torch.long)]),
                 torch.cat(students + [torch.randn(pad, v, dtype=D)]),
                 torch.cat(policies + [torch.randn(pad, v, dtype=D)]),
                 torch.cat(lmasks + [torch.zeros(pad, dtype=torch.long)]), seg)
    torch.testing.assert_close(packed.loss_sum, separate[0].loss_sum + separate[1].loss_sum, rtol=0, atol=1e-12)
    assert packed.num_tokens.item() == separate[0].num_tokens.item() + separate[1].num_tokens.item()
    assert packed.top1_agree.item() == separate[0].top1_agree.item() + separate[1].top1_agree.item()


def test_low_precision_inputs_are_computed_in_float32():
    s, t, mask, _ = _data(seed=12)
    out = draft_loss(s.bfloat16(), t.bfloat16(), mask)
    assert out.loss_sum.dtype == torch.float32
    ref = draft_loss(s.bfloat16().double(), t.bfloat16().double(), mask).loss_sum
    torch.testing.assert_close(out.loss_sum.double(), ref, rtol=1e-5, atol=1e-5)


def test_empty_batch():
    out = draft_loss(torch.zeros(0, 5, requires_grad=True), torch.zeros(0, 5), torch.zeros(0, dtype=torch.bool))
    assert out.loss_sum.item() == 0.0 and out.num_tokens.item() == 0.0
    out.loss_sum.backward()


_S, _T, _M = torch.zeros(3, 4), torch.zeros(3, 4), torch.ones(3, dtype=torch.bool)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(loss_type="kl"), "loss_type='kl'"),
    (dict(loss_type="topk_soft_ce", topk=0), "topk=0"),
    (dict(topk=-3), "topk=-3"),
    (dict(teacher_logits=torch.zeros(3, 5)), "teacher_logits.shape=(3, 5)"),
    (dict(mask=torch.ones(4, dtype=torch.bool)), "mask.shape=(4,)"),
    (dict(mask=torch.ones(3)), "mask.dtype=torch.float32"),
    (dict(loss_type="hard_ce"), "target_ids=None"),
    (dict(loss_type="hard_ce", target_ids=torch.zeros(2, dtype=torch.long)), "target_ids.shape=(2,)"),
    (dict(loss_type="hard_ce", target_ids=torch.tensor([0, 4, 1])), "contains 4"),
    (dict(loss_type="hard_ce", target_ids=torch.tensor([0, 3, 1]), vocab_size=3), "[0, 3)"),
    (dict(vocab_size=0), "vocab_size=0"),
    (dict(vocab_start_index=-1), "vocab_start_index=-1"),
    (dict(student_logits=torch.zeros(3)), "student_logits"),
])
def test_bad_input_raises_naming_arg_value_and_allowed(kwargs, needle):
    args = dict(student_logits=_S, teacher_logits=_T, mask=_M)
    for k in ("student_logits", "teacher_logits", "mask"):
        if k in kwargs:
            args[k] = kwargs.pop(k)
    with pytest.raises(ValueError) as e:
        draft_loss(args["student_logits"], args["teacher_logits"], args["mask"], **kwargs)
    assert needle in str(e.value) and "expected" in str(e.value)


def test_unmasked_targets_may_be_anything():
    out = draft_loss(_S, _T, torch.tensor([True, False, True]), loss_type="hard_ce", target_ids=torch.tensor([1, -100, 2]))
    assert out.num_tokens.item() == 2


@pytest.mark.parametrize("kwargs, needle", [
    (dict(chunk_size=0), "chunk_size=0"),
    (dict(chunk_size=2, output_weight=torch.zeros(4, 5)), "output_weight.shape=(4, 5)"),
    (dict(chunk_size=2, loss_type="nope"), "loss_type='nope'"),
    (dict(chunk_size=2, topk=0), "topk=0"),
])
def test_chunked_bad_input(kwargs, needle):
    weight = kwargs.pop("output_weight", torch.zeros(4, 2))
    with pytest.raises(ValueError) as e:
        chunked_draft_loss(torch.zeros(3, 2), weight, _T, _M, **kwargs)
    assert needle in str(e.value)


@pytest.mark.parametrize("loss_type", DRAFT_LOSS_TYPES)
def test_chunked_projects_no_more_than_unchunked(loss_type):
    """The chunked loss takes each chunk's gradient as it builds the chunk's logits: its forward+backward
    costs the unchunked loss's matmul FLOPs (projection forward, and its input gradient), where rebuilding
    the logits in backward (activation checkpointing) would add a second projection forward."""
    from torch.utils.flop_counter import FlopCounterMode

    n, h, v = 64, 16, 40
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h)
    t, mask = torch.randn(n, v), torch.ones(n, dtype=torch.bool)
    kw = dict(loss_type=loss_type, target_ids=torch.zeros(n, dtype=torch.long), topk=4)

    def flops(fn):
        with FlopCounterMode(display=False) as counter:
            fn().loss_sum.backward()
        return counter.get_total_flops()

    full = flops(lambda: draft_loss(hidden @ weight.t(), t, mask, **kw))
    assert full >= 4 * n * h * v
    assert flops(lambda: chunked_draft_loss(hidden, weight, t, mask, chunk_size=16, **kw)) == full


def test_chunk_tokens_auto_keeps_a_chunks_logits_at_the_element_budget():
    from skyrl_mtp.allowed import MTP_LOSS_CHUNK_AUTO_ELEMENTS
    from skyrl_mtp.mtp.draft_losses import chunk_tokens

    assert chunk_tokens("auto", 8192) == MTP_LOSS_CHUNK_AUTO_ELEMENTS // 8192 == 16384
    assert chunk_tokens("auto", 151_680) == 884          # MiMo's vocab on one rank
    assert chunk_tokens("auto", 75_840) == 1769          # the same over TP 2: a rank's shard
    assert chunk_tokens("auto", 2**30) == 1 and chunk_tokens("auto", 0) == MTP_LOSS_CHUNK_AUTO_ELEMENTS
    assert chunk_tokens(0, 8192) == 0 and chunk_tokens(512, 8192) == 512
    for bad in (-1, 1.5, True, "big", None):
        with pytest.raises(ValueError, match="chunk_size="):
            chunk_tokens(bad, 8192)
