"""Make megatron-core's forward/backward run without CUDA.

megatron-core asks ``torch.cuda.current_device()`` for the device of RoPE tables, its global
memory buffer and MTP metrics, and keeps its model-parallel RNG states in CUDA generators.
Without a GPU both fail. This shim redirects them to the CPU; the device seam (policy/device.py)
applies it when a rank runs on the CPU, and it checks every patch target exists (with the expected call
signature) before touching it.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch

_APPLIED = False


class CpuShimError(RuntimeError):
    """A megatron-core / torch symbol the CPU shim patches is missing or changed."""


def _require_attr(owner, name: str, where: str):
    if not hasattr(owner, name):
        raise CpuShimError(
            f"CPU shim target {where}.{name} is missing in this megatron-core/torch version; "
            "the shim must be updated before Megatron can run on CPU"
        )
    return getattr(owner, name)


def _require_params(fn, params: tuple[str, ...], where: str) -> None:
    names = list(inspect.signature(fn).parameters)
    missing = [p for p in params if p not in names]
    if missing:
        raise CpuShimError(
            f"CPU shim target {where} changed signature: expected parameters {list(params)}, "
            f"got {names} (missing {missing})"
        )


def _cpu_get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_tracker_add(self, name: str, seed: int) -> None:
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cpu rng state {name} already exists")
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()
    self._is_initialized = True


@contextmanager
def _noop_device_ctx(*_args, **_kwargs):
    yield


def apply_cpu_shim(*, force: bool = False) -> bool:
    """Patch megatron-core for CPU. Returns True when patches are (already) active.

    Does nothing (returns False) when CUDA is available, unless ``force``.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available() and not force:
        return False

    from megatron.core.tensor_parallel import random as mrandom

    get_state = _require_attr(mrandom, "_get_cuda_rng_state", "megatron.core.tensor_parallel.random")
    set_state = _require_attr(mrandom, "_set_cuda_rng_state", "megatron.core.tensor_parallel.random")
    tracker = _require_attr(mrandom, "CudaRNGStatesTracker", "megatron.core.tensor_parallel.random")
    add = _require_attr(tracker, "add", "CudaRNGStatesTracker")
    _require_attr(torch.cuda, "current_device", "torch.cuda")
    _require_params(get_state, ("device", "clone", "graph_safe"), "megatron _get_cuda_rng_state")
    _require_params(set_state, ("new_state", "device", "graph_safe"), "megatron _set_cuda_rng_state")
    _require_params(add, ("self", "name", "seed"), "megatron CudaRNGStatesTracker.add")
    for attr in ("states_", "seeds_"):
        if attr not in inspect.getsource(tracker.reset):
            raise CpuShimError(f"CudaRNGStatesTracker.reset no longer sets {attr}; update the CPU shim")

    torch.cuda.current_device = lambda: torch.device("cpu")
    mrandom._get_cuda_rng_state = _cpu_get_rng_state
    mrandom._set_cuda_rng_state = _cpu_set_rng_state
    tracker.add = _cpu_tracker_add
    _APPLIED = True
    return True


def shim_active() -> bool:
    return _APPLIED
