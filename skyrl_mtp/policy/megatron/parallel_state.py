"""Bring up torch.distributed (gloo on CPU, nccl on GPU) and megatron-core model-parallel groups."""

from __future__ import annotations

import torch
import torch.distributed as dist


def init_distributed(*, rank: int, world_size: int, master_addr: str, master_port: int, tp: int, seed: int) -> None:
    """Initialise the default process group and Megatron's TP/DP groups (idempotent)."""
    from megatron.core import parallel_state, tensor_parallel

    from .cpu_shim import apply_cpu_shim

    if world_size % tp:
        raise ValueError(f"world_size={world_size} is not divisible by tp={tp}")
    apply_cpu_shim()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                rank=rank, world_size=world_size)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
