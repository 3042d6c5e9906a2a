"""The policy ranks meet on a port rank 0 holds from its pick on (`PolicyWorker.rendezvous_address` ->
`join`): the other ranks may reach it before rank 0 serves its store, and nothing else can take the port.
Both ranks run in processes of their own (a process group is global to its process)."""

import socket

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.integration


def _rank0(ports, out: str) -> None:
    import time

    import torch.distributed as dist

    from skyrl_mtp.net import listening_socket
    from skyrl_mtp.policy.megatron.parallel_state import init_distributed

    held = listening_socket()
    port = held.getsockname()[1]
    with socket.socket() as rival:
        try:
            rival.bind(("127.0.0.1", port))
            taken = True
        except OSError:
            taken = False
    ports.put(port)
    time.sleep(1.5)   # rank 1 looks for the store first: it waits in the held socket's backlog
    init_distributed(rank=0, world_size=2, master_addr="127.0.0.1", master_port=port, tp=1, seed=0,
                     listen_socket=held)
    x = torch.tensor([1.0])
    dist.all_reduce(x)
    torch.save({"sum": x.item(), "rival_bound": taken}, f"{out}.0")
    dist.destroy_process_group()


def _rank1(port: int, out: str) -> None:
    import torch.distributed as dist

    from skyrl_mtp.policy.megatron.parallel_state import init_distributed

    init_distributed(rank=1, world_size=2, master_addr="127.0.0.1", master_port=port, tp=1, seed=0)
    x = torch.tensor([2.0])
    dist.all_reduce(x)
    torch.save({"sum": x.item()}, f"{out}.1")
    dist.destroy_process_group()


def test_ranks_meet_on_the_port_rank0_holds(tmp_path):
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    out = str(tmp_path / "r")
    first = ctx.Process(target=_rank0, args=(ports, out))
    first.start()
    second = ctx.Process(target=_rank1, args=(ports.get(timeout=120), out))
    second.start()
    for p in (first, second):
        p.join(timeout=180)
        assert p.exitcode == 0
    r0, r1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert r0 == {"sum": 3.0, "rival_bound": False} and r1 == {"sum": 3.0}


def test_only_rank0_may_serve_the_store():
    from skyrl_mtp.net import listening_socket
    from skyrl_mtp.policy.megatron.parallel_state import init_distributed

    with listening_socket() as sock, pytest.raises(ValueError, match="only rank 0 serves the rendezvous store; rank 1"):
        init_distributed(rank=1, world_size=2, master_addr="127.0.0.1", master_port=sock.getsockname()[1], tp=1,
                         seed=0, listen_socket=sock)
