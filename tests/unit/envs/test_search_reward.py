"""Normalised exact match and F1 of search-QA answers."""

import numpy as np
import pytest

from skyrl_mtp.envs.search_reward import (
    exact_match,
    f1_score,
    gold_answers,
    normalize_answer,
    score_answer,
    score_response,
)


def test_normalize_answer():
    assert normalize_answer("  The  Quick, brown FOX!  ") == "quick brown fox"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theater") == "theater"  # articles only as whole words


def test_exact_match_against_any_gold():
    assert exact_match("the Quenta.", ["Mizza", "quenta"]) == 1.0
    assert exact_match("Quenta City", ["Quenta"]) == 0.0


def test_f1_partial_overlap():
    assert f1_score("Quenta City", ["Quenta"]) == pytest.approx(2 / 3)
    assert f1_score("nothing", ["Quenta"]) == 0.0
    assert f1_score("new york city", ["York", "New York City"]) == 1.0


def test_gold_answer_layouts():
    assert gold_answers("a") == ["a"]
    assert gold_answers({"target": ["a", "b"]}) == ["a", "b"]
    assert gold_answers({"target": np.array(["a", "b"], dtype=object)}) == ["a", "b"]
    with pytest.raises(ValueError, match="ground truth"):
        gold_answers({"target": []})
    with pytest.raises(ValueError, match="ground truth"):
        gold_answers(3)


def test_score_response_uses_last_answer():
    r = score_response("<search>q</search><answer>Mizza</answer> ... <answer>The Quenta</answer>", {"target": ["Quenta"]})
    assert (r.score, r.exact_match, r.f1, r.answer) == (1.0, 1.0, 1.0, "The Quenta")
    miss = score_response("<search>q</search> no answer", ["Quenta"])
    assert (miss.score, miss.f1, miss.answer) == (0.0, 0.0, None)
    assert score_answer("Quenta town", ["Quenta"]).score == 0.0
