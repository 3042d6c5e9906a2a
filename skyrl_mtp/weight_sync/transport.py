"""The one seam that picks the weight transport and builds its trainer-side init info.

- `nccl`: engines have GPUs of their own (separate pools); vLLM's NCCL broadcast from the policy's rank 0.
- `ipc`: engines share the policy's GPUs (colocated); vLLM's CUDA IPC handles, no copy over a network.
- `skyrl_cpu`: no GPU; this project's gloo transport (cpu_transport.py), the same calls as `nccl`.
"""

from __future__ import annotations

import socket
from typing import Any

from skyrl_mtp.weight_sync.registration import CPU_BACKEND

BACKENDS = ("nccl", "ipc", CPU_BACKEND)
# vLLM's GPU transports load whatever they are sent; the engine actor checks their updates itself
# (before vLLM's session starts). The CPU transport checks on the workers, all ranks agreeing.
WORKER_CHECKED_BACKENDS = (CPU_BACKEND,)


def choose_backend(on_gpu: bool, gpus_shared_with_policy: bool) -> str:
    if not on_gpu:
        return CPU_BACKEND
    return "ipc" if gpus_shared_with_policy else "nccl"


def needs_rendezvous(backend: str) -> bool:
    return backend != "ipc"


def trainer_init_info(backend: str, *, rank: int, master_address: str | None = None,
                      master_port: int | None = None, world_size: int | None = None,
                      listen_socket: socket.socket | None = None) -> Any:
    """`world_size` = 1 (the sender) + every engine worker. Wire params: packed, so memory stays bounded.
    `listen_socket`: the socket rank 0 holds on `master_port` (`net.listening_socket`; CPU transport only)."""
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

        return IPCTrainerInitInfo(packed=True, rank=rank)
    raise ValueError(f"weight transfer backend {backend!r} is invalid; allowed: {BACKENDS}")
