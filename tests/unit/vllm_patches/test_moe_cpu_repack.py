"""The CPU MoE repack patch checks vLLM's code before it wraps it (the engine-level proof, a synced MoE engine
equal to a fresh one bit for bit, is tests/integration/rollout/test_moe_engines.py)."""

import pytest

from skyrl_mtp.vllm_patches import moe_cpu_repack
from skyrl_mtp.vllm_patches.moe_cpu_repack import MoERepackPatchError, _check


def test_the_patch_installs_once_on_this_vllm():
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    original = UnquantizedFusedMoEMethod._setup_kernel
    try:
        assert moe_cpu_repack.apply() in ("patched", "already")
        assert moe_cpu_repack.apply() == "already"
        assert UnquantizedFusedMoEMethod._setup_kernel.__wrapped__ is not None
    finally:
        if not getattr(original, "__skyrl_mtp_patched__", False):
            UnquantizedFusedMoEMethod._setup_kernel = original


def _guarded(self, layer, w13, w2):
    is_weight_update = self.moe_kernel is not None
    if not is_weight_update:
        self.moe_kernel.fused_experts.process_weights_after_loading(layer)


def _fixed_upstream(self, layer, w13, w2):
    is_weight_update = self.moe_kernel is not None
    self.moe_kernel.fused_experts.process_weights_after_loading(layer)
    if not is_weight_update:
        pass


def _moved(self, layer, w13, w2):
    return None


def _other_signature(self, layer, weights):
    return None


def test_the_check_accepts_the_guarded_call_and_refuses_anything_else():
    _check(_guarded)
    with pytest.raises(MoERepackPatchError, match="would prepack twice"):
        _check(_fixed_upstream)
    with pytest.raises(MoERepackPatchError, match="no longer contains"):
        _check(_moved)
    with pytest.raises(MoERepackPatchError, match=r"takes \['self', 'layer', 'weights'\]"):
        _check(_other_signature)
