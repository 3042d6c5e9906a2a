"""A plan's bundles become a real Ray placement group and its actors land in their bundles (CPU)."""

from __future__ import annotations

import pytest

from skyrl_mtp.cluster.placement import (
    PlacementError,
    actor_options,
    plan_for_running_cluster,
    release,
    reserve,
)
from skyrl_mtp.config import load_config
from skyrl_mtp.trainer.run_plan import placement_plan

pytestmark = pytest.mark.integration


def test_plan_schedules_actors_into_their_bundles(ray_local):
    import ray

    cfg = load_config(["recipe=tiny_dapo"])
    plan = plan_for_running_cluster(placement_plan(cfg))
    pg = reserve(plan, timeout_s=60)
    try:
        @ray.remote
        class Probe:
            def where(self):
                ctx = ray.get_runtime_context()
                return ctx.get_placement_group_id(), ray.get_gpu_ids()

        actors = [Probe.options(**actor_options(pg, a)).remote() for a in plan.engines + plan.policy]
        seen = ray.get([a.where.remote() for a in actors], timeout=60)
        assert [s[0] for s in seen] == [pg.id.hex()] * len(actors)
        assert all(s[1] == [] for s in seen)   # CPU plan: no GPUs
        for a in actors:
            ray.kill(a)
    finally:
        release(pg)


def test_running_cluster_too_small_is_named(ray_local):
    import ray

    cpus = int(ray.cluster_resources()["CPU"])
    cfg = load_config(["recipe=tiny_dapo", f"generator.num_engines={cpus}"])
    with pytest.raises(PlacementError, match=f"cluster too small: needs {cpus + 1} CPUs .* but the cluster has {cpus}"):
        plan_for_running_cluster(placement_plan(cfg))


def test_reserve_names_the_bundles_it_could_not_get_and_leaves_no_group(ray_local):
    import dataclasses

    from ray.util import placement_group_table

    plan = plan_for_running_cluster(placement_plan(load_config(["recipe=tiny_dapo"])))
    pg = reserve(plan, timeout_s=60)                       # the real plan fits
    release(pg)
    greedy = dataclasses.replace(plan, bundles=({"CPU": 4096.0},))
    before = {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}
    with pytest.raises(PlacementError, match=r"bundles \[\{'CPU': 4096.0\}\].*not reserved within 2s"):
        reserve(greedy, timeout_s=2)
    after = {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}
    assert after <= before
