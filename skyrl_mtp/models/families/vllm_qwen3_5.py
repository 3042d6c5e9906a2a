"""vLLM's own Qwen3.5 classes, imported after the torchvision-free alias is installed (see vllm_import.py).

vLLM's registry points the Qwen3.5 (dense and MoE) architectures here (``register_vllm_models``) so that every process
that resolves them (the model-inspection subprocess included) installs the alias before importing them.
"""

from skyrl_mtp.models.families.vllm_import import allow_qwen3_5_import

allow_qwen3_5_import()

from vllm.model_executor.models.qwen3_5 import (  # noqa: E402
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
)
from vllm.model_executor.models.qwen3_5_mtp import Qwen3_5MoeMTP, Qwen3_5MTP  # noqa: E402

__all__ = ["Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MTP", "Qwen3_5MoeForCausalLM",
           "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeMTP"]
