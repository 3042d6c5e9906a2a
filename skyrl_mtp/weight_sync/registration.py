"""Registers the project's CPU weight transport in vLLM's worker-side and trainer-side factories.

vLLM builds the worker-side engine by name from `weight_transfer_config.backend` inside its worker
process (at model load), and the trainer builds its side by the same name; both registries must know
the name in the process that builds. `register_cpu_transport` is idempotent and is called in the vLLM
worker (worker_extension imports it) and wherever a trainer-side engine is built.
"""

from __future__ import annotations

CPU_BACKEND = "skyrl_cpu"
_MODULE = "skyrl_mtp.weight_sync.cpu_transport"


def register_cpu_transport() -> None:
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, cls_name in ((WeightTransferEngineFactory, "CPUWeightTransferEngine"),
                              (WeightTransferTrainerFactory, "CPUTrainerWeightTransferEngine")):
        registry = getattr(factory, "_registry", None)
        if not isinstance(registry, dict):
            raise RuntimeError(f"vLLM's {factory.__name__} has no `_registry` dict any more; skyrl_mtp's CPU weight "
                               "transport registration must be updated for this vLLM version")
        if CPU_BACKEND not in registry:
            factory.register_engine(CPU_BACKEND, _MODULE, cls_name)
