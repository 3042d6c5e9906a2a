"""``PolicyWorker``: the Megatron policy rank as a Ray actor (one per TP x DP rank)."""

from __future__ import annotations

import ray

from skyrl_mtp.net import claim_held, rehold
from skyrl_mtp.policy.megatron_policy import MegatronPolicy
from skyrl_mtp.weight_sync.policy_link import PolicySenderMixin


def node_address() -> str:
    """The address this process's Ray node registered with (``ray start --node-ip-address``), which
    ``ray.util.get_node_ip_address`` does not give when several nodes share a host."""
    node_id = ray.get_runtime_context().get_node_id()
    for n in ray.nodes():
        if n["NodeID"] == node_id:
            return n["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


@ray.remote(num_cpus=1)
class PolicyWorker(PolicySenderMixin, MegatronPolicy):   # the mixin: the trainer side of the weight sync
    """Given ``master_addr``/``master_port`` it joins the process group at once; without them it waits for
    ``join`` (``PolicyGroup.create`` first asks rank 0's actor for ``rendezvous_address``)."""

    def __init__(self, cfg, hf_path: str, rank: int, world_size: int, master_addr: str | None = None,
                 master_port: int | None = None):
        self._pending = (cfg, hf_path, rank, world_size)
        self.rank = rank
        self._listen_socket = None
        if master_addr is not None:
            self.join(master_addr, master_port)

    def rendezvous_address(self) -> tuple[str, int]:
        """This actor's node address and a port on it where the ranks meet when this is rank 0. The port is
        held (a listening socket) until ``join`` serves the rendezvous on it: no other process can take it."""
        ip = node_address()
        self._listen_socket = rehold(self._listen_socket, ip)
        return ip, self._listen_socket.getsockname()[1]

    def join(self, master_addr: str, master_port: int) -> int:
        if self._pending is None:
            raise RuntimeError(f"policy rank {self.rank} has already joined its process group")
        cfg, hf_path, rank, world_size = self._pending
        sock, self._listen_socket = claim_held(self._listen_socket, master_port, rank == 0), None
        MegatronPolicy.__init__(self, cfg, hf_path, rank, world_size, master_addr, master_port, listen_socket=sock)
        self._pending = None
        return self.rank

    def ping(self) -> int:
        return self.rank
