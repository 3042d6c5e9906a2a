"""Sampling parameters of a rollout request and the per-sequence result, independent of vLLM.

`SamplingSpec` is what the trainer and the generators pass around; it validates itself so a bad
value fails in the driver with a clear message instead of deep inside an engine process, and it
translates to vLLM `SamplingParams` keyword arguments without importing vLLM (unit-testable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

FINISH_REASONS = ("stop", "length")


def _bad(field_name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"SamplingSpec.{field_name}={value!r} is invalid: {allowed}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SamplingSpec:
    """temperature 0 = greedy. `seed` (when given) is offset by the prompt's index in a request so
    identical prompts in one request still draw different samples; `n` samples per prompt."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False   # generate max_tokens whatever the model samples (benchmarks and equivalence tests)

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise _bad("temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise _bad("top_p", self.top_p, "a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", self.top_k, "-1 or 0 (disabled) or an int >= 1")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _bad("max_tokens", self.max_tokens, "an int >= 1")
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "an int >= 1")
        if self.seed is not None and not _is_int(self.seed):
            raise _bad("seed", self.seed, "None or an int")
        if not isinstance(self.stop_token_ids, (list, tuple)) or \
                not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "a list of token ids (ints >= 0)")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise _bad("stop", self.stop, "a list of non-empty strings")
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "True or False")
        self.stop_token_ids = list(self.stop_token_ids)
        self.stop = list(self.stop)

    def vllm_kwargs(self, prompt_index: int = 0) -> dict[str, Any]:
        """Keyword arguments for `vllm.SamplingParams` for the prompt at `prompt_index` of a request.

        logprobs=1 makes vLLM return the sampled token's logprob under the TARGET model (plus the top-1).
        """
        return {
            "n": self.n,
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": 0 if self.top_k == -1 else self.top_k,
            "max_tokens": self.max_tokens,
            "stop_token_ids": list(self.stop_token_ids),
            "stop": list(self.stop),
            "seed": None if self.seed is None else self.seed + prompt_index,
            "logprobs": 1,
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "ignore_eos": self.ignore_eos,
        }


@dataclass(frozen=True)
class RequestSpecCounts:
    """Speculative-decoding counts of ONE request (vLLM's per-request spec-decode metrics)."""

    num_steps: int            # verify steps that checked drafts
    num_draft_tokens: int     # draft tokens proposed
    num_accepted_tokens: int  # draft tokens accepted


@dataclass
class GenerationOutput:
    """One sampled continuation: its token ids, the target model's logprob of each, why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str = ""
    spec: RequestSpecCounts | None = None   # None when the engine does not draft (or did not report)
    # (version, start, end): output tokens [start, end) were sampled by the weights labelled `version` (the policy
    # updates they hold); None when the engine's weights carry no numeric label
    weight_versions: list[tuple[int, int, int]] | None = None


def token_versions(spans: list[tuple[int, int, int]] | None, num_tokens: int) -> list[int] | None:
    """Per-token weight versions from (version, start, end) spans covering `num_tokens` tokens; None for None."""
    if spans is None:
        return None
    out: list[int] = []
    for version, start, end in spans:
        if start != len(out) or end < start:
            raise ValueError(f"weight-version spans {spans} are not contiguous from token 0")
        out += [version] * (end - start)
    if len(out) != num_tokens:
        raise ValueError(f"weight-version spans {spans} cover {len(out)} tokens, the output has {num_tokens}")
    return out


def version_spans(versions: list[int]) -> list[tuple[int, int, int]]:
    """(version, start, end) spans of a per-token version list (the inverse of token_versions)."""
    spans: list[tuple[int, int, int]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1][0] == v:
            spans[-1] = (v, spans[-1][1], i + 1)
        else:
            spans.append((v, i, i + 1))
    return spans


def validate_prompts(prompts: Any, vocab_size: int | None = None, max_model_len: int | None = None) -> None:
    """Reject malformed prompt batches before they reach an engine."""
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError(f"prompts={prompts!r} is invalid: a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or len(p) == 0:
            raise ValueError(f"prompts[{i}]={p!r} is invalid: a non-empty list of token ids")
        bad = [t for t in p if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            allowed = "ints >= 0" if vocab_size is None else f"ints in [0, {vocab_size})"
            raise ValueError(f"prompts[{i}] has invalid token ids {bad[:5]}: allowed {allowed}")
        if max_model_len is not None and len(p) >= max_model_len:
            raise ValueError(f"prompts[{i}] has {len(p)} tokens: allowed at most max_model_len - 1 = "
                             f"{max_model_len - 1}")
