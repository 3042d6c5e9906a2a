"""Make megatron-core's forward/backward run without CUDA.

megatron-core asks ``torch.cuda.current_device()`` for the device of RoPE tables, its global
memory buffer and MTP metrics, keeps its model-parallel RNG states in CUDA generators, and builds the
causal mask of a batch without one (``attention_mask=None``, policy/batch_layout.py) on "cuda".
Without a GPU both fail. This shim redirects them to the CPU; the device seam (policy/megatron/device.py)
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


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """megatron.core.transformer.utils.get_default_causal_mask on the CPU: True above the diagonal (masked)."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def apply_cpu_shim(*, force: bool = False) -> bool:
    """Patch megatron-core for CPU. Returns True when patches are (already) active.

    Does nothing (returns False) when CUDA is available, unless ``force``.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available() and not force:
        return False

    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom

    # the local attention's softmax builds the causal mask of a mask-less batch with this name, imported into it
    causal = _require_attr(fused_softmax, "get_default_causal_mask", "megatron.core.fusions.fused_softmax")
    _require_params(causal, ("sq",), "megatron get_default_causal_mask")
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
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask
    _APPLIED = True
    return True


def shim_active() -> bool:
    return _APPLIED


# ---------------------------------------------------------------------------------------------------------
# Megatron's DDP grad buffers + distributed optimizer on CPU (opt-in, for tests: policy/megatron/device.py)
#
# The optimizer side of megatron-core hard-codes CUDA in many small places (0.16.1):
#   tensors created with ``device='cuda'``: optimizer/optimizer.py MixedPrecisionOptimizer.__init__
#   (_dummy_overflow_buf, _scale_one), optimizer/clip_grads.py get_grad_norm_fp32 /
#   clip_grad_by_total_norm_fp32 / count_zeros_fp32, utils.py local_multi_tensor_l2_norm;
#   type-string checks ``param.type() == 'torch.cuda.FloatTensor'`` (and Half/BFloat16):
#   optimizer/distrib_optimizer.py DistributedOptimizer.__init__ / _build_model_and_main_param_groups,
#   optimizer/clip_grads.py clip_grad_by_total_norm_fp32; ``.cuda()`` on loaded state.
# Everything else on that path (buffers, reduce-scatter / all-gather, torch AdamW as the inner optimizer
# when neither TE nor Apex is installed) is device-agnostic or asks ``torch.cuda.current_device()``, which
# ``apply_cpu_shim`` already answers with the CPU. Rather than patch each function, the Megatron optimizer
# calls run under one TorchFunctionMode that, inside its scope only, (1) turns a ``device`` argument naming
# CUDA into the CPU, (2) makes ``Tensor.cuda()`` a no-op on CPU tensors and (3) lets a CPU float tensor answer
# ``.type()`` with its CUDA type name; ``torch.cuda.current_stream()`` answers a CPU stream whose waits are
# no-ops (0.19). Any other CUDA API (streams, events, NCCL allocator) still fails loudly.
# ---------------------------------------------------------------------------------------------------------

_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


def _names_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)  # a CUDA ordinal


def _cuda_on_cpu_mode():
    from torch.overrides import TorchFunctionMode

    tensor_type = _require_attr(torch.Tensor, "type", "torch.Tensor")
    tensor_cuda = _require_attr(torch.Tensor, "cuda", "torch.Tensor")

    class CudaOnCpuMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs and _names_cuda(kwargs["device"]):
                kwargs["device"] = torch.device("cpu")
            if func is tensor_cuda and args and args[0].device.type == "cpu":
                return args[0]
            if func is tensor_type and len(args) == 1 and not kwargs:
                name = func(*args)
                return _CUDA_TYPE_NAMES.get(name, name) if args[0].device.type == "cpu" else name
            return func(*args, **kwargs)

    return CudaOnCpuMode()


@contextmanager
def megatron_optimizer_on_cpu():
    """Scope in which megatron-core's DDP / distributed-optimizer calls run on CPU tensors (see above).
    Needs ``apply_cpu_shim`` (``torch.cuda.current_device()`` -> CPU); fails loudly otherwise."""
    if not _APPLIED:
        raise CpuShimError("megatron_optimizer_on_cpu needs apply_cpu_shim() first (torch.cuda.current_device "
                           "must answer the CPU)")
    from torch import overrides

    _require_attr(overrides, "TorchFunctionMode", "torch.overrides")
    current_stream = _require_attr(torch.cuda, "current_stream", "torch.cuda")
    torch.cuda.current_stream = _cpu_current_stream
    try:
        with _cuda_on_cpu_mode():
            yield
    finally:
        torch.cuda.current_stream = current_stream


def cuda_calls_on_cpu():
    """The same scope for the other megatron-core code that hard-codes CUDA on paths this project runs on CPU:
    the pipeline schedule (a token counter on ``device="cuda"``) and, with pipeline parallelism, GPTModel's
    start-up tie of the first and last stages' embeddings (``weight.data.cuda()`` before an all-reduce)."""
    return megatron_optimizer_on_cpu()


class _CpuStream:
    """What ``torch.cuda.current_stream()`` answers inside ``megatron_optimizer_on_cpu``: CPU ops run in
    order, so waiting on an event or a stream is a no-op (megatron-core 0.19's grad sync waits on the
    current stream for CUDA-graph events it never records on CPU). Anything else a stream can do raises."""

    def wait_event(self, event) -> None:
        if event is not None:
            raise CpuShimError(f"megatron_optimizer_on_cpu: a CUDA event {event!r} to wait on, on CPU")

    def wait_stream(self, stream) -> None:
        if not isinstance(stream, _CpuStream):
            raise CpuShimError(f"megatron_optimizer_on_cpu: waiting on stream {stream!r}, on CPU")


def _cpu_current_stream(device=None) -> _CpuStream:
    return _CpuStream()
