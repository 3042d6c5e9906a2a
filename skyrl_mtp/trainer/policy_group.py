"""The driver's handle on the policy: a group of PolicyWorker Ray actors acting as one model.

Every worker runs the same call (Megatron ranks must enter collectives together). Data-parallel
ranks each receive their own contiguous slice of the batch; tensor/pipeline/context-parallel
ranks of the same data-parallel replica receive the same slice. Results come from rank 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch


def shard_batch(batch: dict[str, torch.Tensor], dp_rank: int, dp: int) -> dict[str, torch.Tensor]:
    """Contiguous slice `dp_rank` of `dp` along the batch dimension (rows must divide evenly)."""
    rows = next(iter(batch.values())).shape[0]
    if rows % dp != 0:
        raise ValueError(f"batch of {rows} rows cannot be split evenly over data-parallel size {dp}")
    per = rows // dp
    return {k: (v[dp_rank * per:(dp_rank + 1) * per] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == rows else v)
            for k, v in batch.items()}


class PolicyGroup:
    def __init__(self, workers: list[Any], tp: int, pp: int, cp: int, dp: int):
        self.workers = workers
        self.tp, self.pp, self.cp, self.dp = tp, pp, cp, dp
        self.dp_ranks = [(rank // (tp * cp)) % dp for rank in range(len(workers))]
        self.master_addr: str | None = None  # where the ranks met (rank 0's node), set by create
        self.master_port: int | None = None

    @classmethod
    def create(cls, worker_cfg: Any, hf_path: str, world_size: int, tp: int, pp: int, cp: int, dp: int,
               num_cpus: float = 1, num_gpus: float = 0, runtime_env: dict | None = None,
               per_rank_options: Sequence[Mapping[str, Any]] | None = None) -> PolicyGroup:
        """`per_rank_options[r]` (e.g. rank r's placement-group bundle) goes on top of the common options."""
        from skyrl_mtp.policy.worker import PolicyWorker

        if per_rank_options is not None and len(per_rank_options) != world_size:
            raise ValueError(f"per_rank_options has {len(per_rank_options)} entries for world_size={world_size}")
        opts: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        if runtime_env:
            opts["runtime_env"] = runtime_env
        workers = [PolicyWorker.options(**{**opts, **(per_rank_options[rank] if per_rank_options else {})})
                   .remote(worker_cfg, hf_path, rank, world_size)
                   for rank in range(world_size)]
        group = cls(workers, tp, pp, cp, dp)
        try:
            # the ranks meet at rank 0's node address, on a port free on that node (multi-node safe)
            group.master_addr, group.master_port = ray.get(workers[0].rendezvous_address.remote())
            group.call("join", group.master_addr, group.master_port)
        except BaseException:
            group.shutdown()
            raise
        return group

    def worker_config(self) -> dict[str, Any]:
        """The configuration rank 0 actually runs with (read back from the actor)."""
        return ray.get(self.workers[0].__ray_call__.remote(lambda worker: worker.cfg.to_dict()))

    def gpu_ids(self) -> list[str]:
        """The GPU id Ray gave each rank (rank order; colocated engines are shown these)."""
        def ids(_worker: Any) -> str:
            return ",".join(str(i) for i in ray.get_gpu_ids())

        return ray.get([w.__ray_call__.remote(ids) for w in self.workers])

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def _sharded(self, method: str, batch: dict[str, torch.Tensor], **kwargs: Any) -> list[Any]:
        refs = [getattr(w, method).remote(shard_batch(batch, r, self.dp), **kwargs)
                for w, r in zip(self.workers, self.dp_ranks)]
        return ray.get(refs)

    def compute_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        outs = self._sharded("compute_logprobs", batch)
        # one result per data-parallel replica, in dp order
        by_dp: dict[int, torch.Tensor] = {}
        for out, r in zip(outs, self.dp_ranks):
            by_dp.setdefault(r, out)
        return torch.cat([by_dp[r] for r in range(self.dp)], dim=0)

    def train_step(self, batch: dict[str, torch.Tensor], **kwargs: Any) -> dict[str, float]:
        return self._sharded("train_step", batch, **kwargs)[0]

    def release_device_memory(self) -> list[list[str]]:
        """Every rank hands its GPU memory over to colocated engines (MegatronPolicy.release_device_memory)."""
        return self.call("release_device_memory")

    def reclaim_device_memory(self) -> list[list[str]]:
        return self.call("reclaim_device_memory")

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self.call("export_weights")[0]

    def save_checkpoint(self, path: str) -> None:
        self.call("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self.call("load_checkpoint", path)

    def shutdown(self) -> None:
        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        except Exception:  # noqa: BLE001 - best effort; the actors are killed next
            pass
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
