"""Re-run vLLM-CPU's MoE weight prepacking after an in-place weight reload, so a synced engine equals a fresh one.

vLLM 0.32 processes an unquantized MoE layer's weights in ``UnquantizedFusedMoEMethod._setup_kernel``
(fused_moe/unquantized_fused_moe_method.py): it converts them to the kernel's format and, on the FIRST load
only (``if not is_weight_update``), calls the experts' own ``process_weights_after_loading``. On CPU that
is where ``CPUUnquantizedExperts`` (fused_moe/experts/cpu_moe.py) pads the intermediate size and prepacks
``w13_weight`` / ``w2_weight`` into its grouped-GEMM layout. An RL weight update (the layerwise reload,
model_loader/reload/layerwise.py) re-runs ``_setup_kernel`` with ``is_weight_update`` True, so the reloaded
weights stay in the plain layout and are copied into tensors the CPU kernel reads as prepacked: the values
arrive, the bytes (and the kernel's reading of them) differ from a fresh engine's.

``apply`` wraps ``_setup_kernel``: after vLLM's own code, on a weight update whose experts are vLLM's CPU
unquantized experts, it calls their ``process_weights_after_loading`` as the first load did. The layerwise
reload then copies the prepacked result into the live tensors. It refuses to patch when the guarded call it
compensates for is no longer guarded (vLLM fixed it: the patch would prepack twice) or has moved.
"""

from __future__ import annotations

import functools
import inspect

MARKERS = ("is_weight_update = self.moe_kernel is not None", "if not is_weight_update:",
           "self.moe_kernel.fused_experts.process_weights_after_loading(layer)")
PARAMS = ("self", "layer", "w13", "w2")


class MoERepackPatchError(RuntimeError):
    """vLLM's MoE weight processing is not the code this patch was written against."""


def _check(method) -> None:
    params = list(inspect.signature(method).parameters)
    if params != list(PARAMS):
        raise MoERepackPatchError(f"UnquantizedFusedMoEMethod._setup_kernel takes {params}, expected {list(PARAMS)}: "
                                  "update skyrl_mtp/vllm_patches/moe_cpu_repack.py")
    src = inspect.getsource(method)
    missing = [m for m in MARKERS if m not in src]
    if missing:
        raise MoERepackPatchError(f"UnquantizedFusedMoEMethod._setup_kernel no longer contains {missing}: vLLM changed "
                                  "how it prepacks MoE weights on a weight update; update "
                                  "skyrl_mtp/vllm_patches/moe_cpu_repack.py (or drop it if fixed upstream)")
    guarded = src.index(MARKERS[1]) < src.index(MARKERS[2])
    if not guarded:
        raise MoERepackPatchError("the experts' process_weights_after_loading is no longer skipped on a weight update "
                                  "in vLLM's _setup_kernel: the CPU repack patch would prepack twice; drop it")


def apply() -> str:
    """Install the wrapper (idempotent); returns "patched" or "already"."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as mod
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    cls = getattr(mod, "UnquantizedFusedMoEMethod", None)
    original = getattr(cls, "_setup_kernel", None)
    if original is None:
        raise MoERepackPatchError("vllm...unquantized_fused_moe_method.UnquantizedFusedMoEMethod._setup_kernel is gone: "
                                  "update skyrl_mtp/vllm_patches/moe_cpu_repack.py")
    if getattr(original, "__skyrl_mtp_patched__", False):
        return "already"
    _check(original)
    if not callable(getattr(CPUUnquantizedExperts, "process_weights_after_loading", None)):
        raise MoERepackPatchError("vLLM's CPUUnquantizedExperts has no process_weights_after_loading: update "
                                  "skyrl_mtp/vllm_patches/moe_cpu_repack.py")

    @functools.wraps(original)
    def _setup_kernel(self, layer, w13, w2):
        is_weight_update = self.moe_kernel is not None
        original(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if is_weight_update and isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)   # pad + prepack, as on the first load

    _setup_kernel.__skyrl_mtp_patched__ = True
    cls._setup_kernel = _setup_kernel
    return "patched"
