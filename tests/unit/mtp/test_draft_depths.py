"""Which draft depths the head trains on when the engines choose k (trainer.mtp.train_depths=null, auto)."""

from __future__ import annotations

import pytest

from skyrl_mtp.mtp.draft_depths import depths_to_train


def test_engines_that_hardly_draft_train_depth_one_only():
    assert depths_to_train([0.95, 0.04, 0.01, 0.0], 3) == 1    # k >= 1 under 10% of steps: probes only


def test_one_depth_beyond_what_the_engines_draft():
    assert depths_to_train([0.5, 0.5, 0.0, 0.0], 3) == 2
    assert depths_to_train([0.2, 0.1, 0.6, 0.1], 3) == 3       # k = 3 at 10%: counted, capped at the maximum
    assert depths_to_train([0.0, 0.0, 0.0, 1.0], 3) == 3


def test_counts_are_normalised_and_no_steps_trains_every_depth():
    assert depths_to_train([90, 5, 3, 2], 3) == 1
    assert depths_to_train([0, 0, 0, 0], 3) == 3
    assert depths_to_train([], 2) == 2


def test_a_maximum_below_one_is_refused():
    with pytest.raises(ValueError, match="max_depths=0"):
        depths_to_train([1.0], 0)


def test_engines_are_idle_when_they_hardly_draft():
    from skyrl_mtp.mtp.draft_depths import engines_idle

    assert engines_idle([0.95, 0.05, 0.0, 0.0])
    assert not engines_idle([0.85, 0.15, 0.0, 0.0])
    assert not engines_idle([0, 0, 0, 0])          # no steps recorded: nothing says drafting is idle
