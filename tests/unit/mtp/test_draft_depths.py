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

    c = HeadTrainingCredit(every=8)
    assert not c.due(0)                      # nothing saved yet, cost unknown
    c.add(-0.3)                              # exploration's cost is not the head's to repay
    assert c.credit == 0.0 and not c.due(1)
    c.add(0.01)
    assert c.due(2)                          # any saving while the head's cost is unknown
    c.trained(0.2)                           # measured: training takes 0.2 s
    assert c.head_seconds == 0.2 and c.credit == 0.0
    due = []
    for step in range(3, 15):
        c.add(0.05)                          # drafting saves 0.05 s a step: a training every 4 steps
        due.append(c.due(step))
        if due[-1]:
            c.trained(0.2)
    assert due == [False, False, False, True,     # steps 3-6: credit 0.05 .. 0.2
                   True,                          # step 7: the every-8th floor (credit 0.05, spent)
                   False, False, False, True,     # steps 8-11: 0.05 .. 0.2 again
                   False, False, False], due
    c.add(10.0)                              # a long stretch where drafting paid banks two trainings at most
    assert c.credit == 0.4


def test_the_head_trains_on_every_nth_step_when_drafting_saves_nothing():
    from skyrl_mtp.mtp.draft_depths import HeadTrainingCredit

    c = HeadTrainingCredit(every=3)
    trained = []
    for step in range(9):
        c.add(0.0)
        trained.append(c.due(step))
        if trained[-1]:
            c.trained(0.1)
    assert trained == [False, False, True] * 3
    with pytest.raises(ValueError, match="idle_head_train_every"):
        HeadTrainingCredit(every=0)
    with pytest.raises(ValueError, match="seconds=-1"):
        c.trained(-1)


def test_the_credit_round_trips_through_a_checkpoint_and_rejects_bad_state():
    from skyrl_mtp.mtp.draft_depths import HeadTrainingCredit

    c = HeadTrainingCredit(every=8)
    c.add(0.05)
    c.trained(0.2)
    c.add(0.15)
    restored = HeadTrainingCredit(every=8)
    restored.load_state_dict(c.state_dict())
    assert (restored.credit, restored.head_seconds) == (c.credit, c.head_seconds) == (0.15, 0.2)
    assert not restored.due(3) and (restored.add(0.05), restored.due(4)) == (None, True)
    fresh = HeadTrainingCredit(every=8)
    fresh.load_state_dict({"credit": 0.0, "head_seconds": None})
    assert fresh.head_seconds is None and not fresh.due(0)
    for bad in ({"credit": -1.0, "head_seconds": 0.1}, {"credit": 0.1, "head_seconds": "x"}, {}):
        with pytest.raises(ValueError, match="head-training credit state"):
            HeadTrainingCredit(every=8).load_state_dict(bad)
