"""The cheaper draft loss: a deterministic, rank-independent subset of the draft positions."""

from __future__ import annotations

import torch

from skyrl_mtp.mtp.draft_head import draft_positions
from skyrl_mtp.mtp.masks import draft_position_mask


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (4, 256), generator=g)
    mask = torch.zeros(4, 256, dtype=torch.bool)
    mask[:, 16:] = True
    return ids, mask


def test_fraction_one_is_the_full_mask_and_fraction_thins_it_per_sequence():
    ids, mask = _batch()
    full = draft_position_mask(mask, 1, None).nonzero(as_tuple=True)
    rows, cols = draft_positions(mask, 1, None, ids, 1.0)
    assert torch.equal(rows, full[0]) and torch.equal(cols, full[1])
    rows, cols = draft_positions(mask, 1, None, ids, 0.25)
    full_set = set(zip(full[0].tolist(), full[1].tolist()))
    assert set(zip(rows.tolist(), cols.tolist())) <= full_set
    for r in range(4):   # about a quarter of EACH sequence's positions
        n_full = int((full[0] == r).sum())
        assert 0.15 * n_full < int((rows == r).sum()) < 0.35 * n_full


def test_subset_is_deterministic_and_moves_with_the_batch_and_depth():
    ids, mask = _batch()
    a = draft_positions(mask, 1, None, ids, 0.25)
    b = draft_positions(mask, 1, None, ids.clone(), 0.25)
    assert all(torch.equal(x, y) for x, y in zip(a, b))          # every rank with the batch picks the same
    other, _ = _batch(1)
    c = draft_positions(mask, 1, None, other, 0.25)
    d2 = draft_positions(mask, 2, None, ids, 0.25)
    key = lambda p: set(zip(p[0].tolist(), p[1].tolist()))  # noqa: E731
    assert key(a) != key(c) and key(a) != key(d2)


def test_a_rows_subset_does_not_depend_on_the_micro_batch_or_rank_that_holds_it():
    # the normaliser counts the whole batch's positions (draft_normaliser) and each micro-batch trains its
    # own: the two agree only if a row's subset is the same wherever the row sits
    ids, mask = _batch()
    whole = draft_positions(mask, 2, None, ids, 0.25)
    key = lambda p, off=0: set(zip((p[0] + off).tolist(), p[1].tolist()))  # noqa: E731
    for size in (1, 2, 3):
        parts = set()
        for i in range(0, 4, size):
            parts |= key(draft_positions(mask[i:i + size], 2, None, ids[i:i + size], 0.25), i)
        assert parts == key(whole), size
    swapped = draft_positions(mask[[1, 0]], 2, None, ids[[1, 0]], 0.25)   # same rows, other order
    assert key(swapped) == {(1 - r, c) for r, c in key(whole) if r < 2}
