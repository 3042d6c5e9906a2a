"""The one seam that picks the weight transport and builds its trainer-side init info.

- `nccl`: engines have GPUs of their own (separate pools); vLLM's NCCL broadcast from the policy's rank 0.
- `ipc`: engines share the policy's GPUs (colocated); vLLM's CUDA IPC handles, no copy over a network.
- `skyrl_cpu`: no GPU; this project's gloo transport (cpu_transport.py), the same calls as `nccl`.

vLLM's packed IPC producer (`packed_tensor.packed_ipc_producer`) copies every tensor into one GPU buffer of
`IPCTrainerInitInfo.packed_buffer_size_bytes` (1 GiB by default) and raises on a tensor larger than it, which
a 7B model's embedding (151680 x 4096 bf16 = 1.24 GB) is: the buffer is sized from the engines' weight
schema (`ipc_buffer_bytes`).
"""

from __future__ import annotations

import math
import socket
from typing import Any

from skyrl_mtp.weight_sync.registration import CPU_BACKEND
from skyrl_mtp.weight_sync.schema import WeightSchema, torch_dtype

BACKENDS = ("nccl", "ipc", CPU_BACKEND)
# vLLM's GPU transports load whatever they are sent; the engine actor checks their updates itself
# (before vLLM's session starts). The CPU transport checks on the workers, all ranks agreeing.
WORKER_CHECKED_BACKENDS = (CPU_BACKEND,)


def choose_backend(on_gpu: bool, gpus_shared_with_policy: bool) -> str:
    if not on_gpu:
        return CPU_BACKEND
    return "ipc" if gpus_shared_with_policy else "nccl"


def largest_tensor_bytes(schema: WeightSchema, engine_dtype: str) -> int:
    """Bytes of the schema's largest tensor as a sync may send it: in the checkpoint's dtype or the engine's
    (`weight_sync.validate_update` allows both), whichever is wider."""
    wide = torch_dtype(engine_dtype).itemsize
    return max((math.prod(spec.shape) * max(torch_dtype(spec.dtype).itemsize, wide) for spec in schema.values()),
               default=0)


def ipc_buffer_bytes(schema: WeightSchema, engine_dtype: str) -> int:
    """The IPC packing buffer: vLLM's default (1 GiB), or the largest tensor rounded up to a MiB if larger."""
    from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES

    need = -(-largest_tensor_bytes(schema, engine_dtype) // 2**20) * 2**20
    return max(int(DEFAULT_PACKED_BUFFER_SIZE_BYTES), need)


def needs_rendezvous(backend: str) -> bool:
    return backend != "ipc"


def trainer_init_info(backend: str, *, rank: int, master_address: str | None = None,
                      master_port: int | None = None, world_size: int | None = None,
                      listen_socket: socket.socket | None = None, ipc_buffer_size: int | None = None) -> Any:
    """`world_size` = 1 (the sender) + every engine worker. Wire params: packed, so memory stays bounded.
    `listen_socket`: the socket rank 0 holds on `master_port` (`net.listening_socket`; CPU transport only).
    `ipc_buffer_size`: the IPC packing buffer in bytes (`ipc_buffer_bytes`; required for `ipc`)."""
    if listen_socket is not None and backend != CPU_BACKEND:
        raise ValueError(f"a held rendezvous socket is only used by the {CPU_BACKEND!r} transport, not {backend!r}")
    if backend == CPU_BACKEND:
        from skyrl_mtp.weight_sync.cpu_transport import CPUTrainerInitInfo

        return CPUTrainerInitInfo(master_address=master_address, master_port=master_port, world_size=world_size,
                                  rank=rank, listen_socket=listen_socket)
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(master_address=master_address, master_port=master_port, world_size=world_size,
                                   packed=True, rank=rank)
    if backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        if ipc_buffer_size is None or ipc_buffer_size < 1:
            raise ValueError(f"ipc_buffer_size={ipc_buffer_size!r} is invalid for the ipc transport: the packing "
                             "buffer must hold the largest tensor (ipc_buffer_bytes(schema, engine_dtype))")
        return IPCTrainerInitInfo(packed=True, rank=rank, packed_buffer_size_bytes=int(ipc_buffer_size))
    raise ValueError(f"weight transfer backend {backend!r} is invalid; allowed: {BACKENDS}")
