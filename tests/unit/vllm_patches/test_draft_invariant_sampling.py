"""Position-keyed rejection sampling (vllm_patches/draft_invariant_sampling.py) on plain tensors.

The simulator below plays both of vLLM's CPU sampling paths on a bigram target (the logits of a
position depend on the previous token only): the plain sampler draws one seed per token from the
request's generator; the speculative path peeks k+1 seeds, samples every position of the drafted
prefix, emits the accepted prefix plus one token, and advances the generator by what it emitted.
Whatever the drafts, both must produce the same sequence. vLLM's own fused Gumbel-argmax kernel
does the sampling.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_mtp.vllm_patches import cpu_kernels as vllm_cpu_kernels
from skyrl_mtp.vllm_patches import draft_invariant_sampling as dis

pytest.importorskip("vllm")
# vLLM's kernels, loaded the way vLLM loads them (the build it picks for this CPU). Results of the Gumbel
# kernel differ between builds, so every test compares runs made here, never numbers recorded elsewhere.
KERNEL_BUILD = vllm_cpu_kernels.load()
V = 24


def _table(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 2.0


def _plain(table: torch.Tensor, seed: int, first: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    out, prev = [], first
    for _ in range(length):
        tok = int(dis.gumbel_argmax_cpu(table[prev][None], torch.tensor([dis.draw_seed(g)]))[0])
        out.append(tok)
        prev = tok
    return out


def _speculative(table: torch.Tensor, seed: int, first: int, length: int, k: int, drafter) -> tuple[list[int], int]:
    g = torch.Generator().manual_seed(seed)
    out, prev, accepted = [], first, 0
    while len(out) < length:
        drafts = drafter(prev, k)
        seeds = dis.peek_seeds(g, k + 1)
        contexts = [prev, *drafts]                      # position j is conditioned on drafts[:j]
        targets = dis.gumbel_argmax_cpu(table[contexts[:k]], torch.tensor(seeds[:k]))
        bonus = dis.gumbel_argmax_cpu(table[contexts[k]][None], torch.tensor(seeds[k:]))
        rows = dis.accept_prefix(torch.tensor(drafts), targets, bonus, [k], k)
        emitted = dis.emitted_counts(rows)[0]
        for _ in range(emitted):
            dis.draw_seed(g)
        toks = rows[0, :emitted].tolist()
        accepted += emitted - 1
        out.extend(toks)
        prev = toks[-1]
    return out[:length], accepted


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_sequence_equals_plain_sampling_whatever_the_drafts(k):
    table = _table()
    greedy = lambda prev, k: [int(table[prev].argmax())] * k        # noqa: E731 - a drafter that is often right
    rng = torch.Generator().manual_seed(5)
    noise = lambda prev, k: torch.randint(0, V, (k,), generator=rng).tolist()   # noqa: E731 - mostly wrong

    def oracle_chain(prev, k):
        toks = []
        for _ in range(k):
            prev = int(table[prev].argmax())
            toks.append(prev)
        return toks

    for seed in range(6):
        ref = _plain(table, seed, first=3, length=40)
        accepted = {}
        for name, drafter in (("greedy", greedy), ("noise", noise), ("oracle_chain", oracle_chain)):
            seq, accepted[name] = _speculative(table, seed, first=3, length=40, k=k, drafter=drafter)
            assert seq == ref, f"k={k} seed={seed} drafter={name}"
        assert accepted["oracle_chain"] > accepted["noise"], accepted   # drafts change speed, not tokens


def test_acceptance_law_matches_rejection_sampling_with_one_hot_drafts():
    # P(accept draft x) must be p(x): the standard rejection sampler's rate for a one-hot draft.
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0] + [-4.0] * (V - 4))
    p = logits.softmax(-1)
    g = torch.Generator().manual_seed(0)
    n = 20000
    seeds = torch.tensor([dis.draw_seed(g) for _ in range(n)])
    tokens = dis.gumbel_argmax_cpu(logits.expand(n, V), seeds)
    freq = torch.bincount(tokens, minlength=V).double() / n
    se = (p * (1 - p) / n).sqrt()
    assert torch.all((freq - p).abs() <= 4 * se + 1e-4), (freq[:5], p[:5])


def test_peek_does_not_advance_and_advanced_copy_lands_on_the_right_seed():
    g = torch.Generator().manual_seed(11)
    peeked = dis.peek_seeds(g, 4)
    assert dis.peek_seeds(g, 4) == peeked
    copy = dis.advanced_copy(g, 3)
    assert dis.draw_seed(copy) == peeked[3]
    assert [dis.draw_seed(g) for _ in range(4)] == peeked        # the original was not moved by the copy


def test_seed_draw_matches_vllm_cpu_sampler_convention():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    theirs = [torch.randint(0, 2**31, (1,), generator=g1, dtype=torch.long).item() for _ in range(5)]
    assert [dis.draw_seed(g2) for _ in range(5)] == theirs


def test_kernel_noise_depends_on_seed_and_row_only():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(2))
    seeds = torch.tensor([5, 6, 7, 8, 9, 10])
    batched = dis.gumbel_argmax_cpu(logits, seeds)
    single = torch.cat([dis.gumbel_argmax_cpu(logits[i:i + 1], seeds[i:i + 1]) for i in range(6)])
    assert torch.equal(batched.reshape(-1), single.reshape(-1))
    assert torch.equal(dis.gumbel_argmax_cpu(logits.flip(0), seeds.flip(0)).reshape(-1), batched.reshape(-1).flip(0))


def test_accept_prefix_rows():
    drafts = torch.tensor([5, 6, 7, 1, 2, 9, 9, 9])
    targets = torch.tensor([5, 6, 8, 3, 2, 9, 9, 9])
    bonus = torch.tensor([[40], [41], [42], [43]])
    rows = dis.accept_prefix(drafts, targets, bonus, [3, 1, 1, 3], 3)
    assert rows.tolist() == [[5, 6, 8, -1], [3, -1, -1, -1], [2, 42, -1, -1], [9, 9, 9, 43]]
    assert dis.emitted_counts(rows) == [3, 1, 2, 4]
    none = dis.accept_prefix(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long),
                             torch.tensor([7, 8]), [0, 0], 0)
    assert none.tolist() == [[7], [8]]


def test_check_vllm_finds_everything_it_patches_and_install_is_reversible():
    pytest.importorskip("vllm")
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    original = RejectionSampler.forward
    cls, constraints = dis.check_vllm()
    assert cls is RejectionSampler and callable(constraints)
    try:
        assert dis.install() == "installed"
        assert RejectionSampler.forward.__wrapped__ is original
        assert dis.install() == "installed"                       # idempotent: not wrapped twice
        assert RejectionSampler.forward.__wrapped__ is original
    finally:
        dis.uninstall()
    assert RejectionSampler.forward is original


def test_check_vllm_fails_loudly_when_the_seed_convention_changes(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.v1.sample.ops import topk_topp_sampler as tts

    def forward_cpu(self, logits, generators, k, p):   # a vLLM that samples differently
        return logits.argmax(-1), None

    monkeypatch.setattr(tts.TopKTopPSampler, "forward_cpu", forward_cpu)
    with pytest.raises(dis.DraftInvariantSamplingError, match="forward_cpu draws its per-token seed"):
        dis.check_vllm()


def test_check_vllm_fails_loudly_when_forward_signature_changes(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    def forward(self, metadata, logits, sampling_metadata):
        return None

    monkeypatch.setattr(RejectionSampler, "forward", forward)
    with pytest.raises(dis.DraftInvariantSamplingError, match="RejectionSampler.forward's parameters"):
        dis.check_vllm()
