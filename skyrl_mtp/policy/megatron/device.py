"""The one place that decides where a policy rank computes: the GPU Ray assigned its actor, or the CPU.

Everything device-specific in the policy asks this module (the tensor device, the torch.distributed
backend, whether the megatron-core CPU shim is needed, whether the Megatron DDP / distributed optimizer
path is taken); nothing else branches on ``torch.cuda.is_available()``.

Under Ray, an actor started with ``num_gpus=1`` sees exactly its GPU(s) through ``CUDA_VISIBLE_DEVICES``
(Ray sets it), so its device is ``cuda:0`` of its own view; an actor without a GPU sees none (Ray sets an
empty ``CUDA_VISIBLE_DEVICES``) and runs on the CPU. Outside Ray (spawned test ranks, torchrun) a rank
takes ``cuda:LOCAL_RANK`` when CUDA is present.

``SKYRL_MTP_MEGATRON_OPTIMIZER_ON_CPU=1`` (opt-in, for tests) gives a CPU rank the Megatron DDP + distributed
optimizer path too, run on CPU tensors and gloo under ``cpu_shim.megatron_optimizer_on_cpu``: the GPU path's
own code, executed where no GPU exists. Without it a CPU rank takes torch AdamW (``TorchSideOptimizer``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

CPU_MEGATRON_OPTIMIZER_ENV = "SKYRL_MTP_MEGATRON_OPTIMIZER_ON_CPU"


@dataclass(frozen=True)
class RankDevice:
    device: torch.device
    backend: str  # torch.distributed backend: "nccl" on CUDA, "gloo" on CPU
    cpu_megatron_optimizer: bool = False  # CPU rank on the Megatron optimizer path (CPU_MEGATRON_OPTIMIZER_ENV)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def clock(self) -> float:
        """perf_counter once this rank's queued device work has finished (CUDA runs asynchronously): for
        timing a stretch of training."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @property
    def moe_token_dispatcher(self) -> str:
        """megatron-core's MoE token dispatcher: "alltoall" on GPU; "allgather" on CPU (the all-to-all dispatcher
        synchronises through CUDA streams; gloo itself runs the collectives either needs)."""
        return "alltoall" if self.is_cuda else "allgather"

    @property
    def megatron_optimizer(self) -> bool:
        """Megatron DDP grad buffers + distributed optimizer on GPU (and on CPU when opted in); torch AdamW
        otherwise."""
        return self.is_cuda or self.cpu_megatron_optimizer


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


def cpu_megatron_optimizer_requested() -> bool:
    """``CPU_MEGATRON_OPTIMIZER_ENV``: unset/"0" (torch AdamW on CPU ranks) or "1" (Megatron's optimizer)."""
    value = os.environ.get(CPU_MEGATRON_OPTIMIZER_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{CPU_MEGATRON_OPTIMIZER_ENV}={value!r} is invalid; allowed: '0', '1'")
    return value == "1"


def rank_device() -> RankDevice:
    """This process's device, from its Ray GPU assignment (or LOCAL_RANK outside Ray)."""
    available = torch.cuda.is_available()
    dev = choose_device(cuda_available=available, cuda_device_count=torch.cuda.device_count() if available else 0,
                        ray_gpu_ids=_ray_gpu_ids(), local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    if not dev.is_cuda and cpu_megatron_optimizer_requested():
        return RankDevice(dev.device, dev.backend, cpu_megatron_optimizer=True)
    return dev


def release_attention_buffer() -> bool:
    """Drop the tensors of megatron-core's global memory buffer (parallel_state.get_global_memory_buffer(): the local
    DotProductAttention's raw [b x heads, S, S] scores, "mpu"), which it otherwise keeps for the process's life;
    ``GlobalMemoryBuffer.get_tensor`` allocates them again at the next forward. True when it held any."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return False
    buf = parallel_state.get_global_memory_buffer()
    held = getattr(buf, "buffer", None)
    if not isinstance(held, dict):
        raise RuntimeError(f"megatron-core's GlobalMemoryBuffer has no dict `buffer` (got {type(held).__name__}): "
                           "policy/megatron/device.py release_attention_buffer must be updated")
    had = bool(held)
    held.clear()
    return had


def hand_over_to_engines(dev: RankDevice, sides: list, *, offload: bool) -> list[str]:
    """After training, before colocated engines wake on this GPU: with `offload` (the memory plan's choice) each
    optimizer side moves its grads and optimizer state to host memory (``offload_to_host``); the local attention's
    score buffer is dropped (``release_attention_buffer``); then the caching allocator's free blocks go back to the
    driver (``torch.cuda.empty_cache``) so the engines can map them. Returns what was done, in order; on the CPU all
    are no-ops (nothing is listed but what ran)."""
    done = []
    if offload and dev.is_cuda:
        for side in sides:
            side.offload_to_host()
            done.append(f"offload {side.name}")
    if dev.is_cuda:
        if release_attention_buffer():
            done.append("release attention buffer")
        torch.cuda.empty_cache()
        done.append("empty_cache")
    return done


def take_back_from_engines(dev: RankDevice, sides: list, *, offload: bool) -> list[str]:
    """After the colocated engines slept: what `hand_over_to_engines` moved to host memory comes back."""
    done = []
    if offload and dev.is_cuda:
        for side in sides:
            side.restore_to_device()
            done.append(f"restore {side.name}")
    return done


def activate(dev: RankDevice) -> None:
    """Make ``dev`` current for libraries that ask torch.cuda for "the" device (megatron-core):
    ``torch.cuda.set_device`` on GPU, the megatron-core CPU shim on CPU."""
    if dev.is_cuda:
        torch.cuda.set_device(dev.device)
    else:
        from skyrl_mtp.policy.megatron.cpu_shim import apply_cpu_shim

        apply_cpu_shim(force=True)
