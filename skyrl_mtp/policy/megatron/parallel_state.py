"""Bring up torch.distributed (gloo on CPU, nccl on GPU: the backend comes from policy/megatron/device.py) and
megatron-core's model-parallel groups."""

from __future__ import annotations

import socket

import torch.distributed as dist


def init_distributed(*, rank: int, world_size: int, master_addr: str, master_port: int, tp: int, seed: int,
                     device=None, listen_socket: socket.socket | None = None, pp: int = 1, ep: int = 1) -> None:
    """Initialise the default process group and Megatron's TP/PP/DP/EP groups (idempotent).

    ``ep``: expert parallel size (MoE models), with expert tensor parallel size 1: each group of ``ep``
    consecutive ranks spreads the routed experts, and a rank's experts are data-parallel over the
    world / ep ranks that hold the same ones (megatron-core's expert grid; ``ep`` divides world_size).

    ``device``: the rank's ``RankDevice`` (default: ``device.rank_device()``); it is made current first.
    ``listen_socket`` (rank 0 only): the socket already bound to ``master_port`` (``net.listening_socket``);
    rank 0's store serves on it, so no other process can take the port between its pick and the rendezvous.
    """
    from megatron.core import parallel_state, tensor_parallel

    from skyrl_mtp.policy.megatron.device import activate, rank_device

    if world_size % (tp * pp) or world_size % ep:
        raise ValueError(f"world_size={world_size} is not divisible by tp*pp={tp}*{pp} and ep={ep}")
    if listen_socket is not None and rank != 0:
        raise ValueError(f"only rank 0 serves the rendezvous store; rank {rank} was given a listen socket")
    dev = device or rank_device()
    activate(dev)
    if not dist.is_initialized():
        kw = {"device_id": dev.device} if dev.is_cuda else {}
        # every rank builds its store the same way (torch prefixes the keys of a store it builds from an
        # init_method, not of one it is given), rank 0 serving it on the held socket when there is one
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0, wait_for_workers=False,
                              timeout=dist.constants.default_pg_timeout,
                              master_listen_fd=None if listen_socket is None else listen_socket.detach())
        dist.init_process_group(dev.backend, store=store, rank=rank, world_size=world_size, **kw)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
