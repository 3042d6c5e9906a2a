"""Placement plans from config + the resources Ray reports (plain dicts), and their error messages."""

from __future__ import annotations

import pytest

from skyrl_mtp.cluster.placement import plan_placement
from skyrl_mtp.config import ConfigError, compose_config, load_config
from skyrl_mtp.config.validation import placement_problems
from skyrl_mtp.errors import PlacementError
from skyrl_mtp.trainer.run_plan import placement_plan


def _cfg(*overrides: str):
    """A composed config (no path/derivation checks needed for placement)."""
    return compose_config(["recipe=tiny_dapo", *overrides])


def _gpu(engines: int, tp: int, workers: int, colocate: bool, *extra: str):
    return _cfg(f"generator.num_engines={engines}", f"generator.tensor_parallel_size={tp}",
                f"trainer.placement.policy_num_workers={workers}", f"trainer.placement.colocate={str(colocate).lower()}",
                "trainer.placement.gpus_per_policy_worker=1", f"trainer.placement.gpus_per_engine={tp}", *extra)


def test_cpu_default_plan():
    plan = plan_placement(placement_plan(_cfg()), {"CPU": 2.0, "memory": 1e10})
    assert plan.device == "cpu" and plan.colocate is False
    assert plan.bundles == ({"CPU": 1.0}, {"CPU": 1.0})
    assert [(a.role, a.index, a.bundle_index, a.num_cpus, a.num_gpus) for a in plan.engines + plan.policy] == [
        ("engine", 0, 0, 1.0, 0.0), ("policy", 0, 1, 1.0, 0.0)]
    assert plan.required == {"CPU": 2.0, "GPU": 0.0}


def test_cpu_too_small_names_cpus():
    with pytest.raises(PlacementError) as info:
        plan_placement(placement_plan(_cfg("generator.num_engines=2")), {"CPU": 2.0})
    assert str(info.value) == ("cluster too small: needs 3 CPUs (2 for 2 engine(s) x 1 + 1 for 1 policy worker(s) x 1) "
                               "but the cluster has 2")


def test_separate_gpu_pools():
    cfg = _gpu(2, 2, 4, False, "megatron.tp=2", "megatron.dp=2")
    plan = plan_placement(placement_plan(cfg), {"CPU": 16.0, "GPU": 8.0})
    assert plan.device == "gpu" and not plan.colocate
    assert plan.bundles[:2] == ({"CPU": 1.0, "GPU": 2.0}, {"CPU": 1.0, "GPU": 2.0})
    assert plan.bundles[2:] == ({"CPU": 1.0, "GPU": 1.0},) * 4
    assert [a.num_gpus for a in plan.engines] == [2.0, 2.0]
    assert [a.bundle_index for a in plan.policy] == [2, 3, 4, 5]
    assert plan.required["GPU"] == 8.0


def test_separate_gpu_too_small_says_requested_vs_available():
    cfg = _gpu(1, 8, 1, False)
    with pytest.raises(PlacementError) as info:
        plan_placement(placement_plan(cfg), {"CPU": 64.0, "GPU": 8.0})
    assert "cluster too small: needs 9 GPUs (8 for 1 engine(s) x 8 workers + 1 for 1 policy worker(s)) but the cluster has 8" \
        in str(info.value)


def test_no_gpus_reported_counts_as_zero():
    with pytest.raises(PlacementError, match="needs 2 GPUs .* but the cluster has 0"):
        plan_placement(placement_plan(_gpu(1, 1, 1, False)), {"CPU": 8.0})


def test_colocated_shares_gpus():
    cfg = _gpu(2, 4, 8, True, "megatron.tp=4", "megatron.dp=2", "trainer.placement.cpus_per_engine=2")
    plan = plan_placement(placement_plan(cfg), {"CPU": 20.0, "GPU": 8.0})
    assert plan.colocate
    assert plan.bundles == ({"CPU": 6.0, "GPU": 4.0}, {"CPU": 6.0, "GPU": 4.0})
    assert plan.required == {"CPU": 12.0, "GPU": 8.0}
    e0, e1 = plan.engines
    assert (e0.bundle_index, e0.num_gpus, e0.num_cpus, e0.shares_gpus_with) == (0, 0.0, 2.0, (0, 1, 2, 3))
    assert (e1.bundle_index, e1.shares_gpus_with) == (1, (4, 5, 6, 7))
    assert [a.bundle_index for a in plan.policy] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(a.num_gpus == 1.0 for a in plan.policy)
    assert "shares GPUs of policy ranks [0, 1, 2, 3]" in plan.describe()


def test_colocated_too_small():
    cfg = _gpu(8, 1, 8, True, "megatron.dp=8")
    with pytest.raises(PlacementError) as info:
        plan_placement(placement_plan(cfg), {"CPU": 64.0, "GPU": 4.0})
    assert "needs 8 GPUs (8 for 8 policy workers (tp*pp*cp*dp); the 8 engines x 1 workers share them) but the cluster has 4" \
        in str(info.value)


def test_engine_tp_must_fit_on_one_node():
    cfg = _gpu(1, 8, 8, False, "megatron.dp=8")
    nodes = [{"CPU": 32.0, "GPU": 4.0}] * 4
    with pytest.raises(PlacementError) as info:
        plan_placement(placement_plan(cfg), {"CPU": 128.0, "GPU": 16.0}, nodes)
    assert str(info.value) == ("cluster too small: engine 0 (8 workers: tensor x pipeline parallel) needs 8 GPUs and 1 CPUs on one node, "
                               "but the largest node has 4 GPUs and 32 CPUs")
    # the same request fits two 8-GPU nodes
    plan = plan_placement(placement_plan(cfg), {"CPU": 64.0, "GPU": 16.0}, [{"CPU": 32.0, "GPU": 8.0}] * 2)
    assert plan.required["GPU"] == 16.0


def test_bundles_that_fit_alone_but_not_together():
    cfg = _gpu(3, 4, 1, False)           # 4 + 4 + 4 + 1 = 13 GPUs; the cluster has 13, but not 4 together thrice
    nodes = [{"CPU": 32.0, "GPU": 6.0}, {"CPU": 32.0, "GPU": 6.0}, {"CPU": 32.0, "GPU": 1.0}]
    with pytest.raises(PlacementError, match="do not pack onto the nodes"):
        plan_placement(placement_plan(cfg), {"CPU": 96.0, "GPU": 13.0}, nodes)
    # one more 4-GPU node and it packs
    assert plan_placement(placement_plan(cfg), {"CPU": 128.0, "GPU": 17.0}, [*nodes, {"CPU": 32.0, "GPU": 4.0}]).required["GPU"] == 13.0


def test_no_alive_nodes():
    with pytest.raises(PlacementError, match="no alive nodes"):
        plan_placement(placement_plan(_cfg()), {"CPU": 2.0}, [])


@pytest.mark.parametrize("overrides, key, allowed", [
    (["trainer.placement.gpus_per_engine=1"], "trainer.placement.gpus_per_policy_worker=0",
     "engines and policy workers must both use GPUs or both use CPUs"),
    (["trainer.placement.gpus_per_policy_worker=1"], "trainer.placement.gpus_per_engine=0",
     "engines and policy workers must both use GPUs or both use CPUs"),
    (["generator.tensor_parallel_size=2", "trainer.placement.gpus_per_engine=1", "trainer.placement.gpus_per_policy_worker=1"],
     "trainer.placement.gpus_per_engine=1", "must equal generator.tensor_parallel_size * pipeline_parallel_size = 2"),
    (["trainer.placement.gpus_per_engine=1", "trainer.placement.gpus_per_policy_worker=2"],
     "trainer.placement.gpus_per_policy_worker=2", "must be 1 on GPUs (one Megatron rank per GPU)"),
    (["generator.num_engines=2", "trainer.placement.gpus_per_engine=1", "trainer.placement.gpus_per_policy_worker=1",
      "trainer.placement.colocate=true"], "trainer.placement.colocate=True",
     "needs generator.num_engines * tensor_parallel_size * pipeline_parallel_size = 2*1 = 2 to equal trainer.placement.policy_num_workers = 1"),
])
def test_inconsistent_layouts(overrides, key, allowed):
    problems = placement_problems(_cfg(*overrides))
    assert len(problems) == 1
    assert problems[0].startswith(f"{key} is invalid: {allowed}")
    # validate_config reports it before anything starts
    with pytest.raises(ConfigError) as info:
        load_config(["recipe=tiny_dapo", *overrides])
    assert f"{key} is invalid: {allowed}" in str(info.value)


def test_cpu_colocate_is_a_no_op():
    plan = plan_placement(placement_plan(_cfg("trainer.placement.colocate=true", "generator.num_engines=2")), {"CPU": 3.0})
    assert plan.colocate is False
    assert plan.bundles == ({"CPU": 1.0},) * 3


def test_accepts_typed_config():
    from skyrl_mtp.config.loader import to_typed

    typed = to_typed(load_config(["recipe=tiny_dapo"]))
    assert plan_placement(placement_plan(typed), {"CPU": 2.0}).required == {"CPU": 2.0, "GPU": 0.0}


def test_pipeline_parallel_engines_take_a_gpu_per_worker():
    """An engine with TP 2 x PP 2 runs four workers: its bundle holds four GPUs on one node."""
    base = ("generator.num_engines=1", "generator.tensor_parallel_size=2", "generator.pipeline_parallel_size=2",
            "trainer.placement.policy_num_workers=1", "trainer.placement.gpus_per_policy_worker=1")
    plan = plan_placement(placement_plan(_cfg(*base, "trainer.placement.gpus_per_engine=4")), {"CPU": 16.0, "GPU": 5.0})
    assert plan.bundles[0] == {"CPU": 1.0, "GPU": 4.0} and plan.required["GPU"] == 5.0
    problems = placement_problems(_cfg(*base, "trainer.placement.gpus_per_engine=2"))
    assert problems == ["trainer.placement.gpus_per_engine=2 is invalid: must equal generator.tensor_parallel_size * "
                        "pipeline_parallel_size = 4 (one GPU per worker of an engine), or 0 for CPU engines"]
