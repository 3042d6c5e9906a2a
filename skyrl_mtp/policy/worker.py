"""``PolicyWorker``: the Megatron policy rank as a Ray actor (one per TP x DP rank)."""

from __future__ import annotations

import ray

from .megatron_policy import MegatronPolicy


@ray.remote(num_cpus=1)
class PolicyWorker(MegatronPolicy):
    def ping(self) -> int:
        return self.rank
