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


def test_the_head_trains_when_its_drafts_saved_what_its_training_costs():
    from skyrl_mtp.mtp.draft_depths import HeadTrainingCredit

    c = HeadTrainingCredit(budget=0.01)
    assert not c.due()                       # nothing saved yet, cost unknown
    c.add(-0.3)                              # exploration's cost is not the head's to repay
    assert c.credit == 0.0 and not c.due()
    c.add(0.01)
    assert c.due()                           # any saving while the head's cost is unknown
    c.trained(0.2)                           # measured: training takes 0.2 s
    assert c.head_seconds == 0.2 and c.credit == 0.0
    due = []
    for _ in range(8):
        c.add(0.05)                          # drafting saves 0.05 s a step: a training every 4 steps
        due.append(c.due())
        if due[-1]:
            c.trained(0.2)
    assert due == [False, False, False, True] * 2, due
    c.add(10.0)                              # a long stretch where drafting paid banks two trainings at most
    assert c.credit == 0.4


def test_the_allowance_trains_an_idle_head_on_a_budgeted_share_of_the_time():
    from skyrl_mtp.mtp.draft_depths import HeadTrainingCredit

    c = HeadTrainingCredit(budget=0.25)
    trained = []
    for _ in range(9):
        c.add(0.0)                           # drafting saves nothing
        trained.append(c.due())
        if trained[-1]:
            c.trained(1.0)                   # the head's training takes as long as a step
        c.allow(2.0)                         # steps of 2 s (the head's training aside): 0.5 s each
    assert trained == [False, True, False, True, False, True, False, True, False], trained
    c.allow(100.0)
    assert c.credit == 2.0                   # capped at two trainings' worth
    for bad in (0, 0.0, -0.1, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match="idle_head_train_budget"):
            HeadTrainingCredit(budget=bad)
    with pytest.raises(ValueError, match="seconds=-1"):
        c.trained(-1)


def test_the_credit_round_trips_through_a_checkpoint_and_rejects_bad_state():
    from skyrl_mtp.mtp.draft_depths import HeadTrainingCredit

    c = HeadTrainingCredit(budget=0.01)
    c.add(0.05)
    c.trained(0.2)
    c.add(0.15)
    restored = HeadTrainingCredit(budget=0.01)
    restored.load_state_dict(c.state_dict())
    assert (restored.credit, restored.head_seconds) == (c.credit, c.head_seconds) == (0.15, 0.2)
    assert not restored.due() and (restored.add(0.05), restored.due()) == (None, True)
    fresh = HeadTrainingCredit(budget=0.01)
    fresh.load_state_dict({"credit": 0.0, "head_seconds": None})
    assert fresh.head_seconds is None and not fresh.due()
    for bad in ({"credit": -1.0, "head_seconds": 0.1}, {"credit": 0.1, "head_seconds": "x"}, {}):
        with pytest.raises(ValueError, match="head-training credit state"):
            HeadTrainingCredit(budget=0.01).load_state_dict(bad)
