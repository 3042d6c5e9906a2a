"""vLLM's finished outputs as the project's `GenerationOutput`: the sampled tokens' logprobs, the request's
speculative-decoding counts and the weight version of every token."""

from __future__ import annotations

from typing import Any

from skyrl_mtp.rollout.sampling import FINISH_REASONS, GenerationOutput, RequestSpecCounts


def completion_to_output(completion: Any) -> GenerationOutput:
    """vLLM CompletionOutput -> GenerationOutput, picking each sampled token's logprob (logprobs=1)."""
    token_ids = [int(t) for t in completion.token_ids]
    if completion.logprobs is None or len(completion.logprobs) < len(token_ids):
        raise RuntimeError(f"vLLM returned {len(token_ids)} tokens but "
                           f"{0 if completion.logprobs is None else len(completion.logprobs)} logprob entries")
    logprobs = []
    for pos, tok in enumerate(token_ids):
        entry = completion.logprobs[pos].get(tok)
        if entry is None:
            raise RuntimeError(f"vLLM's logprobs at position {pos} lack the sampled token {tok}")
        logprobs.append(float(entry.logprob))
    reason = completion.finish_reason
    if reason not in FINISH_REASONS:
        raise RuntimeError(f"vLLM request ended with finish_reason={reason!r} (expected one of {FINISH_REASONS})")
    return GenerationOutput(token_ids=token_ids, logprobs=logprobs, finish_reason=reason,
                            text=completion.text or "", spec=request_spec_counts(completion),
                            weight_versions=weight_version_spans(completion))


def weight_version_spans(completion: Any) -> list[tuple[int, int, int]] | None:
    """vLLM's per-token weight-version spans of a finished output as (version, start, end); None where a span
    carries no numeric label (vLLM's "default": the engine was never labelled)."""
    spans = getattr(completion, "weight_versions", None)
    if not spans or not all(str(s.version).isdigit() for s in spans):
        return None
    return [(int(s.version), int(s.start), int(s.end)) for s in spans]


def request_spec_counts(completion: Any) -> RequestSpecCounts | None:
    """The request's drafted/accepted counts from vLLM's `CompletionOutput.spec_decode_metrics`
    (filled when the engine runs with per_request_spec_decode_metrics); None when absent."""
    m = getattr(completion, "spec_decode_metrics", None)
    if m is None:
        return None
    hist = list(m.histogram)   # hist[j] = verify steps that accepted j drafts
    return RequestSpecCounts(num_steps=int(sum(hist)), num_draft_tokens=int(m.num_draft_tokens),
                             num_accepted_tokens=int(sum(j * c for j, c in enumerate(hist))))
