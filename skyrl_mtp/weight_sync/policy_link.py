"""The link from the policy's ranks to the engines: where the trainer side of the weight sync runs.

The weights live in the policy's ranks, so the trainer-side transfer engine is built there
(`PolicySenderMixin`, mixed into `PolicyWorker`): every rank streams its export in lockstep (a TP
collective), rank 0 sends. `PolicyEngineLink` (driver side) sets that up once and pushes one sync per
step: main model, then MTP drafter (step_sync.StepSync adds the prefix-cache reset and colocation calls).
"""

from __future__ import annotations

from typing import Any

from skyrl_mtp.net import claim_held
from skyrl_mtp.weight_sync.registration import CPU_BACKEND
from skyrl_mtp.weight_sync.transport import ipc_buffer_bytes, needs_rendezvous, trainer_init_info


def _agree_over_ranks(problem: str | None) -> str | None:
    """Every policy rank takes rank 0's verdict (only rank 0 holds full tensors and checks them)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problem
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rank0_address(worker: Any, backend: str) -> tuple[str, int | None]:
    """Rank 0's address and, where the backend meets at a rendezvous, its port. The CPU transport serves the
    rendezvous on a socket that rank 0 holds from now on (`init_weight_sender` hands it over); vLLM's NCCL
    trainer endpoint binds the port itself, so for it the port is only known to be free now."""
    import ray

    from skyrl_mtp.net import free_port, rehold

    addr = ray.util.get_node_ip_address()
    held, worker._transfer_listen_socket = getattr(worker, "_transfer_listen_socket", None), None
    if backend == CPU_BACKEND:
        worker._transfer_listen_socket = rehold(held, addr)
        return addr, worker._transfer_listen_socket.getsockname()[1]
    claim_held(held, None, serves=False)   # nothing served on it here: closed
    return addr, (free_port(addr) if needs_rendezvous(backend) else None)


class PolicySenderMixin:
    """Mixed into `PolicyWorker`: needs `self.rank` and `self.iter_hf_weights(part)`."""

    def init_weight_sender(self, backend: str, master_address: str | None, master_port: int | None,
                           world_size: int, engine_actors: list[Any], workers_per_engine: int, parts: list[str],
                           schema: dict, engine_dtype: str) -> None:
        from skyrl_mtp.weight_sync.engine_actors_client import EngineActorsClient
        from skyrl_mtp.weight_sync.sender import WeightSender
        from skyrl_mtp.weight_sync.sources import PolicyWeightSource

        old = getattr(self, "_weight_sender", None)
        if old is not None:
            old.shutdown()
        device = None
        if backend != "skyrl_cpu":   # vLLM's GPU transports send device tensors
            import torch

            device = torch.device("cuda", torch.cuda.current_device())
        sock = claim_held(getattr(self, "_transfer_listen_socket", None), master_port, self.rank == 0)
        self._transfer_listen_socket = None
        info = trainer_init_info(backend, rank=self.rank, master_address=master_address, master_port=master_port,
                                 world_size=world_size, listen_socket=sock,
                                 ipc_buffer_size=ipc_buffer_bytes(schema, engine_dtype) if backend == "ipc" else None)
        sources = {p: PolicyWeightSource(self.iter_hf_weights, p, device) for p in parts}
        self._weight_sender = WeightSender(info, EngineActorsClient(engine_actors, workers_per_engine), sources,
                                           parts, schema, engine_dtype, agree=_agree_over_ranks)

    def push_weights_to_engines(self, parts: list[str] | None = None) -> dict[str, float]:
        sender = getattr(self, "_weight_sender", None)
        if sender is None:
            raise RuntimeError("init_weight_sender was not called on this policy rank")
        return sender.push(parts=parts)


class PolicyEngineLink:
    """Driver side. `policy_workers`: the PolicyWorker actors (rank order); `engines`: an EngineClient."""

    def __init__(self, policy_workers: list[Any], engines: Any):
        import ray

        self.workers, self.engines = list(policy_workers), engines
        backend = engines.cfg.weight_transfer_backend
        addr, port = ray.get(self.workers[0].__ray_call__.remote(_rank0_address, backend))
        engines.release_driver_sender()   # the engines' workers now join the policy's transfer group
        ray.get([w.init_weight_sender.remote(backend, addr, port, engines.transfer_world_size, engines.actors,
                                             engines.cfg.workers_per_engine, engines.sync_parts, engines.schema,
                                             engines.cfg.dtype)
                 for w in self.workers])

    def push(self, parts: list[str] | None = None) -> dict[str, float]:
        """One sync (main model, then drafter; `parts`: only these): every policy rank streams, rank 0 sends."""
        import ray

        return ray.get([w.push_weights_to_engines.remote(parts) for w in self.workers])[0]
