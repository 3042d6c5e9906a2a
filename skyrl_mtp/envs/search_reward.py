"""Search-QA reward: SQuAD-style normalised exact match against gold answers (the reward), F1 as a metric."""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass

from skyrl_mtp.data.search_protocol import extract_answer

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


@dataclass(frozen=True)
class SearchReward:
    score: float          # the RL reward: exact match (1.0 / 0.0)
    exact_match: float
    f1: float
    answer: str | None    # the extracted answer (None: the policy never answered)


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def gold_answers(ground_truth) -> list[str]:
    """Accept 'ans', ['a', 'b'] or {'target': [...]} (the Search-R1 reward_model.ground_truth layout)."""
    gt = ground_truth.get("target") if isinstance(ground_truth, dict) else ground_truth
    if hasattr(gt, "tolist") and not isinstance(gt, (str, list, tuple)):
        gt = gt.tolist()  # numpy arrays read back from parquet
    golds = [gt] if isinstance(gt, str) else list(gt) if isinstance(gt, (list, tuple)) else None
    if not golds or not all(isinstance(g, str) for g in golds):
        raise ValueError(f"ground truth must be a string, a non-empty list of strings or {{'target': [...]}}, got {ground_truth!r}")
    return golds


def exact_match(prediction: str, golds: list[str]) -> float:
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golds: list[str]) -> float:
    """Best token-level F1 over the gold answers."""
    pred = normalize_answer(prediction).split()
    return max(_f1(pred, normalize_answer(g).split()) for g in golds)


def score_answer(answer: str | None, ground_truth) -> SearchReward:
    golds = gold_answers(ground_truth)
    if answer is None:
        return SearchReward(0.0, 0.0, 0.0, None)
    em = exact_match(answer, golds)
    return SearchReward(em, em, f1_score(answer, golds), answer)


def score_response(response_text: str, ground_truth) -> SearchReward:
    """Score the last <answer>..</answer> of a whole response (0 when there is none)."""
    return score_answer(extract_answer(response_text), ground_truth)
