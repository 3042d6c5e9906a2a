"""Bring up torch.distributed (gloo on CPU, nccl on GPU: the backend comes from policy/device.py) and
megatron-core's model-parallel groups."""

from __future__ import annotations

import torch.distributed as dist


def init_distributed(*, rank: int, world_size: int, master_addr: str, master_port: int, tp: int, seed: int,
                     device=None) -> None:
    """Initialise the default process group and Megatron's TP/DP groups (idempotent).

    ``device``: the rank's ``RankDevice`` (default: ``device.rank_device()``); it is made current first.
    """
    from megatron.core import parallel_state, tensor_parallel

    from ..device import activate, rank_device

    if world_size % tp:
        raise ValueError(f"world_size={world_size} is not divisible by tp={tp}")
    dev = device or rank_device()
    activate(dev)
    if not dist.is_initialized():
        kw = {"device_id": dev.device} if dev.is_cuda else {}
        dist.init_process_group(dev.backend, init_method=f"tcp://{master_addr}:{master_port}",
                                rank=rank, world_size=world_size, **kw)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
