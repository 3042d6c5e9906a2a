"""Rule-based math reward: extract the final answer and check it with math_verify, never raising.

math_verify's own timeouts use SIGALRM, which only works in a process's main thread (not in Ray actor
threads), so they are disabled here and each verification runs in a single-worker child process whose
result is awaited with a timeout; a hung child is killed and replaced.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import multiprocessing as mp
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RewardResult:
    score: float
    extracted: str | None
    error: bool = False
    timeout: bool = False


def extract_last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces allowed); None when absent or unbalanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def math_verify_equal(pred: str, gold: str) -> bool:
    """True when math_verify judges `pred` equal to `gold` (both wrapped in $...$ for LaTeX parsing)."""
    from math_verify import parse, verify

    g = parse(f"${gold}$", parsing_timeout=None)
    p = parse(f"${pred}$", parsing_timeout=None)
    if not g or not p:
        return pred.strip() == gold.strip()
    return bool(verify(g, p, timeout_seconds=None))


def _verifier_process_init() -> None:
    # The verifier process is a fork of the trainer and inherits its whole heap (torch, Ray, tokenizers).
    # Frozen, those objects are never traversed by this process's garbage collector: without it the first
    # full collection (after enough parsing) walked them all, ~1 s at full CPU in the middle of a step.
    gc.freeze()


def _check(verifier: Callable[[str, str], bool], pred: str, gold: str) -> bool:
    return verifier(pred, gold)


class MathReward:
    """score 1.0 when the extracted answer verifies against ground truth, else 0.0."""

    def __init__(
        self,
        *,
        answer_pattern: str | None = None,
        timeout_s: float = 5.0,
        verifier: Callable[[str, str], bool] = math_verify_equal,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        try:
            self._pattern = re.compile(answer_pattern) if answer_pattern else None
        except re.error as e:
            raise ValueError(f"answer_pattern={answer_pattern!r} is not a valid regex: {e}") from e
        if self._pattern is not None and self._pattern.groups < 1:
            raise ValueError(f"answer_pattern={answer_pattern!r} needs one capture group for the answer")
        self.timeout_s = timeout_s
        self.verifier = verifier
        self._pool: cf.ProcessPoolExecutor | None = None

    def extract(self, response: str) -> str | None:
        boxed = extract_last_boxed(response)
        if boxed is not None:
            return boxed
        if self._pattern is not None:
            matches = self._pattern.findall(response)
            if matches:
                last = matches[-1]
                return (last[0] if isinstance(last, tuple) else last).strip() or None
        return None

    def _get_pool(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("fork"),
                                                initializer=_verifier_process_init)
        return self._pool

    def _kill_pool(self) -> None:
        if self._pool is not None:
            for p in list(getattr(self._pool, "_processes", {}).values()):
                p.kill()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def score(self, response: str, ground_truth: str) -> RewardResult:
        try:
            pred = self.extract(response) if isinstance(response, str) else None
        except Exception:
            return RewardResult(0.0, None, error=True)
        if pred is None:
            return RewardResult(0.0, None)
        try:
            fut = self._get_pool().submit(_check, self.verifier, pred, str(ground_truth))
            ok = fut.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            self._kill_pool()
            return RewardResult(0.0, pred, timeout=True)
        except Exception:
            if isinstance(self._pool, cf.ProcessPoolExecutor) and getattr(self._pool, "_broken", False):
                self._kill_pool()
            return RewardResult(0.0, pred, error=True)
        return RewardResult(1.0 if ok else 0.0, pred)

    def score_batch(self, responses: Sequence[str], ground_truths: Sequence[str]) -> list[RewardResult]:
        if len(responses) != len(ground_truths):
            raise ValueError(f"responses ({len(responses)}) and ground_truths ({len(ground_truths)}) lengths differ")
        return [self.score(r, g) for r, g in zip(responses, ground_truths)]

    def __getstate__(self) -> dict:
        # the worker pool is per-process; a copy shipped to a Ray actor starts its own
        state = dict(self.__dict__)
        state["_pool"] = None
        return state

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def reward_metrics(results: Sequence[RewardResult]) -> dict[str, float]:
    n = max(len(results), 1)
    return {
        "reward/mean": sum(r.score for r in results) / n,
        "reward/num_errors": float(sum(r.error for r in results)),
        "reward/num_timeouts": float(sum(r.timeout for r in results)),
    }
