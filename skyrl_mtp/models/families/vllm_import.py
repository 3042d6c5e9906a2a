"""Make vLLM's Qwen3.5 model code importable where torchvision is absent (CPU builds of this project).

vllm/model_executor/models/qwen3_5.py imports qwen3_vl.py, which imports ``smart_resize`` from
transformers' torchvision-backed Qwen2-VL image processor module; ``make setup`` removes torchvision (its
CUDA build breaks ``import vllm``), so the import fails although text-only Qwen3.5 never resizes an image.
transformers ships the same processor on PIL (``image_processing_pil_qwen2_vl``, with ``smart_resize``):
``allow_qwen3_5_import`` points the torchvision module's name at it, after checking that torchvision is
really missing and that the PIL module still has what vLLM imports (else it fails loudly).

The alias must exist in every process that imports the model code: the engine process, vLLM's
model-inspection subprocess and its workers. ``register_vllm_models`` therefore re-registers vLLM's
Qwen3.5 architectures to ``vllm_qwen3_5`` (this package), which installs the alias and re-exports vLLM's
own classes; the worker extension calls it in each worker.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

TV_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
# what vLLM's qwen3_vl.py takes from TV_MODULE
NEEDED = ("smart_resize",)
# vLLM architecture name -> (vLLM module, class)
ARCHITECTURES = {
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MTP": ("qwen3_5_mtp", "Qwen3_5MTP"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
    "Qwen3_5MoeMTP": ("qwen3_5_mtp", "Qwen3_5MoeMTP"),
}


class VLLMImportError(ImportError):
    """vLLM's model code for a family cannot be made importable."""


def torchvision_missing() -> bool:
    return importlib.util.find_spec("torchvision") is None


def allow_qwen3_5_import() -> str:
    """Install the alias if needed; returns "native" (torchvision present), "aliased" or "already"."""
    if not torchvision_missing():
        return "native"
    current = sys.modules.get(TV_MODULE)
    if current is not None:
        if getattr(current, "__name__", "") == PIL_MODULE:
            return "already"
        raise VLLMImportError(f"{TV_MODULE} is already imported from {getattr(current, '__file__', '?')} although "
                              "torchvision is missing; refusing to replace it")
    try:
        pil = importlib.import_module(PIL_MODULE)
    except ImportError as e:
        raise VLLMImportError(f"cannot make vLLM's Qwen3.5 importable without torchvision: {PIL_MODULE} does not "
                              f"import ({e}); this transformers version needs another shim") from e
    missing = [n for n in NEEDED if not hasattr(pil, n)]
    if missing:
        raise VLLMImportError(f"{PIL_MODULE} lacks {missing}, which vLLM's qwen3_vl.py imports from {TV_MODULE}; "
                              "this transformers version needs another shim")
    sys.modules[TV_MODULE] = pil
    return "aliased"


def register_vllm_models() -> None:
    """Point vLLM's registry for the Qwen3.5 architectures at ``vllm_qwen3_5`` (this process only)."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    missing = [a for a in ARCHITECTURES if a not in supported]
    if missing:
        raise VLLMImportError(f"this vLLM registers no {missing}: Qwen3.5 serving needs vLLM >= 0.17 (have "
                              f"{importlib.import_module('vllm').__version__})")
    for arch, (_, cls) in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, f"skyrl_mtp.models.families.vllm_qwen3_5:{cls}")
