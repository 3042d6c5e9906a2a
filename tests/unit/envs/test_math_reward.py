"""MathReward: extraction, math_verify equivalence, malformed input, errors and timeouts are counted."""

import pickle
import threading
import time

import pytest

from skyrl_mtp.envs.math_reward import MathReward, extract_last_boxed, reward_metrics


def _slow(pred, gold):
    time.sleep(30)
    return True


def _boom(pred, gold):
    raise RuntimeError("verifier crashed")


@pytest.fixture(scope="module")
def reward():
    r = MathReward(answer_pattern=r"Answer: (.*)")
    yield r
    r.close()


def test_extract_nested_and_last():
    assert extract_last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_last_boxed("\\boxed{x") is None
    assert extract_last_boxed("no box") is None


def test_scores(reward):
    res = reward.score_batch(
        ["47+38=85. \\boxed{85}", "\\boxed{84}", "so \\boxed{\\frac{1}{2}}", "Answer: 12", "garbage \\boxed{", ""],
        ["85", "85", "0.5", "12", "3", "3"],
    )
    assert [r.score for r in res] == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert not any(r.error or r.timeout for r in res)
    assert res[2].extracted == "\\frac{1}{2}"
    clone = pickle.loads(pickle.dumps(reward))  # ships to Ray actors after use
    assert clone.score("\\boxed{7}", "7").score == 1.0
    clone.close()


def test_timeout_from_non_main_thread_and_errors():
    r = MathReward(timeout_s=1.0, verifier=_slow)
    out = {}
    t0 = time.time()
    th = threading.Thread(target=lambda: out.setdefault("r", r.score("\\boxed{1}", "1")))
    th.start()
    th.join(20)
    assert out["r"].timeout and out["r"].score == 0.0
    assert time.time() - t0 < 10
    r.verifier = _boom
    bad = r.score_batch(["\\boxed{1}", "\\boxed{2}"], ["1", "2"])
    assert all(b.error and b.score == 0.0 for b in bad)
    m = reward_metrics([out["r"], *bad])
    assert m == {"reward/mean": 0.0, "reward/num_errors": 2.0, "reward/num_timeouts": 1.0}
    r.close()


def _inherited_heap_is_frozen(pred: str, gold: str) -> bool:
    import gc

    return gc.get_freeze_count() > 0


def test_the_verifier_process_never_collects_the_heap_it_inherits():
    # the verifier runs in a fork of the trainer; a full garbage collection there walked the trainer's whole
    # heap (~1 s of CPU in the middle of an RL step) until the inherited objects were frozen
    import gc

    assert gc.get_freeze_count() == 0   # the parent is untouched: only the verifier process freezes
    r = MathReward(verifier=_inherited_heap_is_frozen)
    try:
        assert r.score("\\boxed{1}", "1").score == 1.0
    finally:
        r.close()
    assert gc.get_freeze_count() == 0


def test_bad_config():
    with pytest.raises(ValueError, match="answer_pattern"):
        MathReward(answer_pattern="Answer: .*")
    with pytest.raises(ValueError, match="timeout_s"):
        MathReward(timeout_s=0)
