"""Speculative rollouts whose tokens do not depend on the drafts: position-keyed rejection sampling.

Why this exists: vLLM's rejection sampler is lossless in distribution, but *which* token it emits
depends on the draft, because the accept test and the recovered-token draw consume the request's
random stream differently for different drafts. Two RL runs that differ only in how the MTP head is
trained then see different samples from the first accepted draft on, so "draft training never
touches the policy" could only be checked in distribution, never bitwise.

vLLM's MTP drafter proposes greedy drafts (no draft probabilities: q is one-hot). For that case this
module swaps the coupling, not the law: the target token of output position t is drawn as
y_t = GumbelArgmax(p_t; seed_t) with noise keyed to t, the draft is accepted iff it equals y_t, and at
the first mismatch y_t is emitted. P(accept) = p_t(draft) and the emitted token given rejection
follows p_t restricted to the other tokens, exactly as in standard rejection sampling with a one-hot
draft, so acceptance rates are unchanged. But the emitted token is y_t whatever was drafted: spec
rollouts equal non-spec rollouts token for token (up to floating-point noise in the target logits).

Keying: on CPU vLLM's plain sampler (`TopKTopPSampler.forward_cpu`) draws one int per call from
each seeded request's generator and samples with `torch.ops._C.fused_gumbel_argmax` on that seed, so
a request's t-th output token uses the t-th int of its generator. The patched
`RejectionSampler.forward` peeks the next k ints (the generator state is saved and restored) and
samples the k draft positions with them; the bonus position (k+1) is sampled by vLLM's own sampler,
handed a copy of the generator advanced by k. It emits the accepted prefix plus one token and then
advances the generator by exactly the number of tokens it emitted.

Cases it does not cover fall back to vLLM's sampler (logged once): probabilistic drafts
(draft_probs given), synthetic acceptance mode, fp64 Gumbel noise, a non-CPU sampler, all-greedy
batches (already draft-invariant). `install()` checks every vLLM name it relies on and raises
`DraftInvariantSamplingError` naming what moved. It runs in vLLM's worker process, from the
project's worker extension, when the engine's settings ask for it (generator.draft_invariant_sampling).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

SEED_HIGH = 2**31   # forward_cpu draws torch.randint(0, 2**31, (1,), generator=gen)
FORWARD_PARAMS = ("metadata", "draft_probs", "logits", "sampling_metadata")
METADATA_FIELDS = ("draft_token_ids", "num_draft_tokens", "cu_num_draft_tokens",
                   "target_logits_indices", "bonus_logits_indices", "max_spec_len")

logger = logging.getLogger(__name__)
STATE: dict[str, Any] = {"status": None, "fallbacks": {}}


class DraftInvariantSamplingError(RuntimeError):
    """The vLLM code this module patches is missing or changed."""


# ------------------------------------------------------------------------------------- pure parts

def draw_seed(generator: torch.Generator | None) -> int:
    """The int vLLM's CPU sampler draws per sampled token (global RNG for unseeded requests)."""
    return int(torch.randint(0, SEED_HIGH, (1,), generator=generator, dtype=torch.long).item())


def peek_seeds(generator: torch.Generator | None, count: int) -> list[int]:
    """The next `count` per-token seeds of `generator`, leaving it where it was."""
    if generator is None:
        return [draw_seed(None) for _ in range(count)]
    state = generator.get_state()
    try:
        return [draw_seed(generator) for _ in range(count)]
    finally:
        generator.set_state(state)


def advanced_copy(generator: torch.Generator, draws: int) -> torch.Generator:
    """A new generator in the state `generator` would reach after `draws` more seeds."""
    copy = torch.Generator(device=generator.device)
    copy.set_state(generator.get_state())
    for _ in range(draws):
        draw_seed(copy)
    return copy


def accept_prefix(draft_token_ids: torch.Tensor, target_token_ids: torch.Tensor, bonus_token_ids: torch.Tensor,
                  num_draft_tokens: list[int], max_spec_len: int, placeholder: int = -1) -> torch.Tensor:
    """Rows of emitted tokens: the drafts that equal the target tokens, then one more token.

    `draft_token_ids` and `target_token_ids` are flat over the batch ([sum(num_draft_tokens)]), the
    target token being the sample of the same position; `bonus_token_ids` is [batch] (or [batch, 1]),
    the sample of the position after the last draft. Row i holds y_0..y_a (a = the index of the first
    mismatch, or the bonus when every draft matched) and `placeholder` after.
    """
    batch = len(num_draft_tokens)
    out = torch.full((batch, max_spec_len + 1), placeholder, dtype=torch.int32)
    drafts = draft_token_ids.to("cpu", torch.int64).tolist()
    targets = target_token_ids.to("cpu", torch.int64).tolist()
    bonus = bonus_token_ids.reshape(-1).to("cpu", torch.int64).tolist()
    start = 0
    for i, n in enumerate(num_draft_tokens):
        row = []
        for j in range(n):
            row.append(targets[start + j])
            if drafts[start + j] != targets[start + j]:
                break
        else:
            row.append(bonus[i])
        out[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
        start += n
    return out.to(draft_token_ids.device)


def emitted_counts(output_token_ids: torch.Tensor, placeholder: int = -1) -> list[int]:
    return (output_token_ids != placeholder).sum(dim=1).tolist()


def gumbel_argmax_cpu(logits: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU sampling kernel: argmax of logits + Gumbel noise generated from (seed, vocab index)."""
    return torch.ops._C.fused_gumbel_argmax(logits.to(torch.float32).contiguous(), seeds)


# ----------------------------------------------------------------------------------- the vLLM patch

def _fallback_reason(sampler: Any, draft_probs: Any, sampling_metadata: Any) -> str | None:
    if sampling_metadata.all_greedy:
        return "all_greedy"
    if draft_probs is not None:
        return "probabilistic drafts (draft_probs given)"
    if getattr(sampler, "synthetic_mode", False):
        return "synthetic acceptance mode"
    if getattr(sampler, "use_fp64_gumbel", False):
        return "fp64 Gumbel noise"
    topk_topp = getattr(sampler.sampler, "topk_topp_sampler", None)
    forward = getattr(getattr(topk_topp, "forward", None), "__func__", None)
    if forward is None or forward.__name__ != "forward_cpu":
        return "the sampler is not vLLM's CPU sampler (position keying is implemented for forward_cpu only)"
    return None


def _note_fallback(reason: str) -> None:
    counts = STATE["fallbacks"]
    counts[reason] = counts.get(reason, 0) + 1
    if counts[reason] == 1 and reason != "all_greedy":
        logger.warning("draft-invariant sampling: falling back to vLLM's rejection sampler (%s)", reason)


def make_forward(original: Callable, apply_sampling_constraints: Callable) -> Callable:
    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        reason = _fallback_reason(self, draft_probs, sampling_metadata)
        if reason is not None:
            _note_fallback(reason)
            return original(self, metadata, draft_probs, logits, sampling_metadata)
        return _invariant_forward(self, metadata, logits, sampling_metadata, apply_sampling_constraints)
    forward.__wrapped__ = original
    forward.__doc__ = "RejectionSampler.forward with position-keyed sampling (skyrl_mtp.vllm_patches.draft_invariant_sampling)."
    return forward


def _invariant_forward(self, metadata, logits, sampling_metadata, apply_sampling_constraints):
    from vllm.v1.outputs import SamplerOutput

    num_draft = list(metadata.num_draft_tokens)
    generators: dict[int, torch.Generator] = sampling_metadata.generators
    seeds = [peek_seeds(generators.get(i), n) for i, n in enumerate(num_draft)]       # the draft positions
    bonus_generators = {i: advanced_copy(g, num_draft[i]) for i, g in generators.items()}   # the next one
    bonus_out = self.sampler(
        logits=logits[metadata.bonus_logits_indices],
        sampling_metadata=replace(sampling_metadata, max_num_logprobs=-1, generators=bonus_generators),
        predict_bonus_token=True,
        logprobs_mode_override="processed_logits" if self.is_processed_logprobs_mode else "raw_logits",
    )

    raw_target_logits = logits[metadata.target_logits_indices].to(torch.float32)
    target_logits = raw_target_logits if self.is_processed_logprobs_mode else raw_target_logits.clone()
    target_logits = self.apply_logits_processors(target_logits, sampling_metadata, metadata)
    target_logits = apply_sampling_constraints(target_logits, metadata.cu_num_draft_tokens, sampling_metadata)

    target_tokens = torch.empty(0, dtype=torch.int64)
    if target_logits.shape[0]:
        row_seeds = torch.tensor([s for row in seeds for s in row], dtype=torch.long)
        target_tokens = gumbel_argmax_cpu(target_logits, row_seeds).reshape(-1).to(torch.int64)
        if not sampling_metadata.all_random:
            greedy_rows = torch.repeat_interleave(sampling_metadata.temperature.cpu() < 1e-5,
                                                  torch.tensor(num_draft)).to(target_logits.device)
            target_tokens = torch.where(greedy_rows, target_logits.argmax(dim=-1), target_tokens)

    output_token_ids = accept_prefix(metadata.draft_token_ids, target_tokens, bonus_out.sampled_token_ids,
                                     num_draft, metadata.max_spec_len)
    for i, emitted in enumerate(emitted_counts(output_token_ids)):
        if i in generators:
            for _ in range(emitted):
                draw_seed(generators[i])

    logprobs_tensors = None
    if sampling_metadata.max_num_logprobs is not None:
        logprobs_tensors = self._get_logprobs_tensors(
            sampling_metadata.max_num_logprobs, metadata, logits,
            target_logits if self.is_processed_logprobs_mode else raw_target_logits,
            bonus_out.logprobs_tensors.logprobs, output_token_ids)
    return SamplerOutput(sampled_token_ids=output_token_ids, logprobs_tensors=logprobs_tensors)


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise DraftInvariantSamplingError(
            f"vLLM changed {what}; skyrl_mtp.vllm_patches.draft_invariant_sampling must be updated for this vLLM "
            f"version (or set generator.draft_invariant_sampling=false)")


def check_vllm() -> tuple[Any, Callable]:
    """The RejectionSampler class and apply_sampling_constraints, after checking everything relied on."""
    try:
        from vllm.v1.sample import rejection_sampler as rs
        from vllm.v1.sample.ops import topk_topp_sampler as tts
        from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    except ImportError as e:
        raise DraftInvariantSamplingError(f"cannot import vLLM's sampler modules: {e}") from e
    cls = getattr(rs, "RejectionSampler", None)
    _require(cls is not None, "vllm.v1.sample.rejection_sampler.RejectionSampler (gone)")
    original = getattr(cls.forward, "__wrapped__", cls.forward)
    params = tuple(inspect.signature(original).parameters)[1:]
    _require(params == FORWARD_PARAMS, f"RejectionSampler.forward's parameters (now {params}, expected {FORWARD_PARAMS})")
    for attr in ("_get_logprobs_tensors", "apply_logits_processors"):
        _require(callable(getattr(cls, attr, None)), f"RejectionSampler.{attr} (gone)")
    _require(getattr(rs, "PLACEHOLDER_TOKEN_ID", None) == -1, "rejection_sampler.PLACEHOLDER_TOKEN_ID (not -1)")
    constraints = getattr(rs, "apply_sampling_constraints", None)
    _require(callable(constraints), "rejection_sampler.apply_sampling_constraints (gone)")
    fields = set(getattr(SpecDecodeMetadata, "__dataclass_fields__", {})) | {"max_spec_len"}
    _require(all(f in fields for f in METADATA_FIELDS), f"SpecDecodeMetadata's fields (need {METADATA_FIELDS})")
    forward_cpu = getattr(getattr(tts, "TopKTopPSampler", None), "forward_cpu", None)
    _require(forward_cpu is not None, "TopKTopPSampler.forward_cpu (gone)")
    source = inspect.getsource(forward_cpu)
    _require("fused_gumbel_argmax" in source and "generator=gen" in source and "2**31" in source,
             "how TopKTopPSampler.forward_cpu draws its per-token seed (expected torch.randint(0, 2**31, (1,), "
             "generator=gen) then torch.ops._C.fused_gumbel_argmax)")
    return cls, constraints


def install() -> str:
    """Patch RejectionSampler.forward in this process (idempotent). Returns the status string."""
    cls, constraints = check_vllm()
    if getattr(cls.forward, "__wrapped__", None) is not None:
        return STATE["status"] or "installed"
    from skyrl_mtp.vllm_patches import cpu_kernels as vllm_cpu_kernels

    vllm_cpu_kernels.load()     # the build vLLM picks for this CPU; a no-op inside vLLM's worker
    try:
        _ = torch.ops._C.fused_gumbel_argmax
    except (AttributeError, RuntimeError) as e:
        raise DraftInvariantSamplingError("torch.ops._C.fused_gumbel_argmax is not registered "
                                          "(vLLM's CPU ops not loaded)") from e
    cls.forward = make_forward(cls.forward, constraints)
    STATE["status"] = "installed"
    return "installed"


def uninstall() -> None:
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    original = getattr(RejectionSampler.forward, "__wrapped__", None)
    if original is not None:
        RejectionSampler.forward = original
    STATE["status"] = None


def apply_if_enabled(enabled: bool) -> str:
    if not enabled:
        STATE["status"] = "disabled"
        return "disabled"
    return install()
