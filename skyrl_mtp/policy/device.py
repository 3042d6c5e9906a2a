"""The one place that decides where a policy rank computes: the GPU Ray assigned its actor, or the CPU.

Everything device-specific in the policy asks this module (the tensor device, the torch.distributed
backend, whether the megatron-core CPU shim is needed, whether the Megatron DDP / distributed optimizer
path is taken); nothing else branches on ``torch.cuda.is_available()``.

Under Ray, an actor started with ``num_gpus=1`` sees exactly its GPU(s) through ``CUDA_VISIBLE_DEVICES``
(Ray sets it), so its device is ``cuda:0`` of its own view; an actor without a GPU sees none (Ray sets an
empty ``CUDA_VISIBLE_DEVICES``) and runs on the CPU. Outside Ray (spawned test ranks, torchrun) a rank
takes ``cuda:LOCAL_RANK`` when CUDA is present.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RankDevice:
    device: torch.device
    backend: str  # torch.distributed backend: "nccl" on CUDA, "gloo" on CPU

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def megatron_optimizer(self) -> bool:
        """Megatron DDP grad buffers + distributed optimizer (CUDA-only in megatron-core); torch AdamW on CPU."""
        return self.is_cuda


def choose_device(*, cuda_available: bool, cuda_device_count: int, ray_gpu_ids: list | None,
                  local_rank: int) -> RankDevice:
    """Pure decision. ``ray_gpu_ids``: the actor's Ray GPU ids (None outside a Ray actor)."""
    if ray_gpu_ids is not None:  # inside a Ray actor: its assignment decides
        if ray_gpu_ids and cuda_available and cuda_device_count > 0:
            return RankDevice(torch.device("cuda", 0), "nccl")
        if ray_gpu_ids:
            raise RuntimeError(f"Ray assigned GPU(s) {ray_gpu_ids} to this policy rank but torch sees no CUDA "
                               "device (a CPU-only torch build on a GPU node?)")
        return RankDevice(torch.device("cpu"), "gloo")
    if cuda_available and cuda_device_count > 0:
        return RankDevice(torch.device("cuda", local_rank % cuda_device_count), "nccl")
    return RankDevice(torch.device("cpu"), "gloo")


def _ray_gpu_ids() -> list | None:
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return None
    if not ray.is_initialized():
        return None
    if ray.get_runtime_context().get_actor_id() is None:  # the driver / a task: no actor assignment
        return None
    return list(ray.get_gpu_ids())


def rank_device() -> RankDevice:
    """This process's device, from its Ray GPU assignment (or LOCAL_RANK outside Ray)."""
    available = torch.cuda.is_available()
    return choose_device(cuda_available=available, cuda_device_count=torch.cuda.device_count() if available else 0,
                         ray_gpu_ids=_ray_gpu_ids(), local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def activate(dev: RankDevice) -> None:
    """Make ``dev`` current for libraries that ask torch.cuda for "the" device (megatron-core):
    ``torch.cuda.set_device`` on GPU, the megatron-core CPU shim on CPU."""
    if dev.is_cuda:
        torch.cuda.set_device(dev.device)
    else:
        from .megatron.cpu_shim import apply_cpu_shim

        apply_cpu_shim(force=True)
