"""A GPU engine of several workers inside the run's placement group: the executor vLLM resolves from the engine's
kwargs (vLLM's own ParallelConfig, with the CUDA platform and a Ray actor inside the placement group stood in) must
accept the bundle the placement reserves for that engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from skyrl_mtp.cluster.placement import PlacementRequest, build_plan
from skyrl_mtp.rollout.config import EngineConfig
from skyrl_mtp.rollout.engine import WORKER_EXTENSION_CLS, engine_defaults

LAYOUTS = [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
           {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}]


def _plan(cfg: EngineConfig, colocate: bool):
    n = cfg.workers_per_engine
    return build_plan(PlacementRequest(num_engines=2, engine_workers=n, policy_workers=2 * n, cpus_per_engine=2,
                                       cpus_per_policy_worker=1, gpus_per_engine=n, gpus_per_policy_worker=1,
                                       colocate=colocate))


def _visible_gpus(plan, engine) -> int:
    """GPUs the engine actor sees: its Ray GPUs, or (colocated, 0 Ray GPUs) the ids of the policy ranks it shares."""
    return len(engine.shares_gpus_with) if plan.colocate else int(engine.num_gpus)


@pytest.fixture
def engine_actor_on_gpus(monkeypatch):
    """Inside an engine actor on a GPU node, in the run's placement group: vLLM's CUDA platform checks (is_cuda,
    device_count) and Ray's view (initialized, the current placement group) stood in; returns a setter for both."""
    import ray
    import vllm.config.parallel as parallel_module
    import vllm.platforms
    import vllm.v1.executor.ray_utils  # noqa: F401 - imported on the real platform (module-level platform reads)

    state = {}

    def place(plan, visible: int):
        platform = SimpleNamespace(
            is_tpu=lambda: False, is_cuda=lambda: True, is_rocm=lambda: False, is_xpu=lambda: False,
            is_cuda_alike=lambda: True, device_count=lambda: visible, use_custom_allreduce=lambda: True,
            ray_device_key="GPU", device_name="cuda")
        monkeypatch.setattr(parallel_module, "current_platform", platform)
        monkeypatch.setattr(vllm.platforms, "_current_platform", platform)
        state["pg"] = SimpleNamespace(bundle_specs=[dict(b) for b in plan.bundles])
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util, "get_current_placement_group", lambda: state["pg"])
    return place


def _resolved_backend(kwargs: dict):
    from vllm.config import ParallelConfig

    return ParallelConfig(tensor_parallel_size=kwargs["tensor_parallel_size"],
                          pipeline_parallel_size=kwargs["pipeline_parallel_size"],
                          distributed_executor_backend=kwargs.get("distributed_executor_backend"))


@pytest.mark.parametrize("colocate", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_multi_gpu_engine_in_the_placement_group_runs_vllms_multiprocessing_executor(engine_actor_on_gpus,
                                                                                        layout, colocate):
    cfg = EngineConfig(model_path="/x", **layout)
    plan = _plan(cfg, colocate)
    engine = plan.engines[0]
    bundle = plan.bundles[engine.bundle_index]
    assert bundle["GPU"] == cfg.workers_per_engine            # one bundle holds all the engine's GPUs
    engine_actor_on_gpus(plan, _visible_gpus(plan, engine))
    kwargs = {**cfg.engine_kwargs, **cfg.managed_engine_kwargs(WORKER_EXTENSION_CLS), **engine_defaults(cfg, on_cpu=False)}
    parallel = _resolved_backend(kwargs)
    # vLLM keeps the multiprocessing executor, whose workers use the GPUs the engine actor sees: as many as it has
    # workers (ParallelConfig raises when fewer are visible)
    assert parallel.distributed_executor_backend == "mp" and parallel.world_size == cfg.workers_per_engine
    assert _visible_gpus(plan, engine) == parallel.world_size


def test_left_to_vllm_the_same_engine_gets_the_ray_executor_which_refuses_the_bundle(engine_actor_on_gpus):
    from vllm.v1.executor.ray_utils import initialize_ray_cluster

    cfg = EngineConfig(model_path="/x", tensor_parallel_size=2)
    plan = _plan(cfg, colocate=False)
    engine_actor_on_gpus(plan, _visible_gpus(plan, plan.engines[0]))
    kwargs = {**cfg.managed_engine_kwargs(WORKER_EXTENSION_CLS)}   # no executor named: what GPU engines got before
    parallel = _resolved_backend(kwargs)
    assert parallel.distributed_executor_backend == "ray"
    with pytest.raises(ValueError, match="Placement group bundle cannot have more than 1 GPU"):
        initialize_ray_cluster(parallel)


def test_one_worker_engines_keep_vllms_choice_and_engine_kwargs_cannot_name_the_ray_executor():
    assert engine_defaults(EngineConfig(model_path="/x"), on_cpu=False) == {}
    assert engine_defaults(EngineConfig(model_path="/x", tensor_parallel_size=4), on_cpu=False) == {
        "distributed_executor_backend": "mp"}
    with pytest.raises(ValueError, match=r"engine_kwargs=\{'distributed_executor_backend': 'ray'\} is invalid: "
                                         r"distributed_executor_backend one of \('mp',\) for an engine of 4 worker"):
        EngineConfig(model_path="/x", tensor_parallel_size=4, engine_kwargs={"distributed_executor_backend": "ray"})
    with pytest.raises(ValueError, match=r"one of \('mp', 'uni'\) for an engine of 1 worker"):
        EngineConfig(model_path="/x", engine_kwargs={"distributed_executor_backend": "ray"})
    EngineConfig(model_path="/x", pipeline_parallel_size=2, engine_kwargs={"distributed_executor_backend": "mp"})
