"""A colocated GPU plan on the local GPUs: policy ranks get whole GPUs, each engine lands on the node
of the policy ranks it shares GPUs with and can read their GPU ids (what the trainer gives it as
CUDA_VISIBLE_DEVICES)."""

from __future__ import annotations

import pytest
import torch

from skyrl_mtp.cluster.placement import actor_options, plan_placement, release, reserve
from skyrl_mtp.config import compose_config
from skyrl_mtp.trainer.run_plan import placement_plan

pytestmark = pytest.mark.gpu


def test_colocated_plan_on_local_gpus(ray_local):
    ray = pytest.importorskip("ray")   # the lent GPU machine may lack Ray's wheel (too large to carry)

    gpus = torch.cuda.device_count()
    cfg = compose_config(["recipe=tiny_dapo", f"generator.num_engines={gpus}", "generator.tensor_parallel_size=1",
                          f"trainer.placement.policy_num_workers={gpus}", f"megatron.dp={gpus}",
                          "trainer.placement.colocate=true", "trainer.placement.gpus_per_engine=1",
                          "trainer.placement.gpus_per_policy_worker=1"])
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    plan = plan_placement(placement_plan(cfg), ray.cluster_resources(), nodes)
    assert plan.colocate and plan.required["GPU"] == gpus
    pg = reserve(plan, timeout_s=60)
    try:
        @ray.remote
        class Probe:
            def where(self):
                return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

        policy = {a.index: Probe.options(**actor_options(pg, a)).remote() for a in plan.policy}
        engines = [Probe.options(**actor_options(pg, a)).remote() for a in plan.engines]
        policy_seen = {r: ray.get(p.where.remote(), timeout=60) for r, p in policy.items()}
        engine_seen = ray.get([e.where.remote() for e in engines], timeout=60)
        assert sorted(g for _, ids in policy_seen.values() for g in ids) == sorted(str(i) for i in range(gpus))
        for a, (node, ids) in zip(plan.engines, engine_seen):
            assert ids == []                                   # Ray accounts the GPUs to the policy ranks
            assert {policy_seen[r][0] for r in a.shares_gpus_with} == {node}   # same node as its policy ranks
        for actor in [*policy.values(), *engines]:
            ray.kill(actor)
    finally:
        release(pg)
