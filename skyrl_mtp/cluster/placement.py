"""Where engines and policy workers run: a bundle plan checked against what the Ray cluster has.

A run asks (`PlacementRequest`, from its run plan) for `generator.num_engines` vLLM engines of
`generator.tensor_parallel_size * pipeline_parallel_size` GPUs each (one per worker; an engine's pipeline stages
run on one node) and `trainer.placement.policy_num_workers` Megatron ranks (= tp*pp*cp*dp), either in separate
GPU pools or colocated (each GPU hosts one policy rank and one engine rank; engines sleep while the policy
trains). Planning is a pure function of the request and of the resources Ray reports, so a cluster too small
fails before any actor starts, with the numbers that do not add up.

The plan is one placement group (strategy PACK):
- separate: one bundle per engine `{CPU: cpus_per_engine, GPU: TP}` (TP here: all the engine's workers, tensor x
  pipeline parallel; they must sit on one node), then one bundle per policy rank `{CPU: cpus_per_policy_worker,
  GPU: 1}`. An engine of several workers runs them with vLLM's multiprocessing executor on the GPUs its actor
  sees; the engine names that executor itself (rollout/engine.py `gpu_engine_defaults`), since vLLM would pick its
  Ray executor inside a placement group, which refuses bundles of more than one GPU.
- colocated (GPU): one bundle per engine `{CPU: cpus_per_engine + TP*cpus_per_policy_worker,
  GPU: TP}`, holding that engine and the TP policy ranks that share its GPUs. Ray accounts the
  GPUs to the policy ranks (num_gpus=1 each); the engine actor takes num_gpus=0 and must be given
  the GPU ids of `shares_gpus_with` (CUDA_VISIBLE_DEVICES), which are on its node by construction.
- CPU (all gpus_* = 0): like separate with GPU 0; `colocate` changes nothing on CPU (there is no
  device memory to hand over, and vLLM's sleep is a no-op there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from skyrl_mtp.errors import PlacementError


@dataclass(frozen=True)
class PlacementRequest:
    """What a run asks of the cluster (built from `trainer.placement.*` and `generator.*` by the run plan)."""

    num_engines: int
    engine_workers: int              # workers (GPUs on GPUs) of one engine: tensor x pipeline parallel size
    policy_workers: int              # Megatron ranks (= tp*pp*cp*dp)
    cpus_per_engine: float
    cpus_per_policy_worker: float
    gpus_per_engine: int             # 0: CPU engines
    gpus_per_policy_worker: int      # 0: CPU policy ranks
    colocate: bool


@dataclass(frozen=True)
class ActorPlacement:
    role: str                       # "engine" or "policy"
    index: int                      # engine index, or policy rank
    bundle_index: int               # into PlacementPlan.bundles
    num_cpus: float
    num_gpus: float
    shares_gpus_with: tuple[int, ...] = ()   # colocated engine: the policy ranks whose GPUs it uses


@dataclass(frozen=True)
class PlacementPlan:
    device: str                                  # "cpu" or "gpu"
    colocate: bool                               # GPUs actually shared (False on CPU)
    bundles: tuple[dict[str, float], ...]
    strategy: str
    engines: tuple[ActorPlacement, ...]
    policy: tuple[ActorPlacement, ...]
    required: dict[str, float]                   # totals over bundles: {"CPU": .., "GPU": ..}
    request: PlacementRequest | None = None      # what it was built from

    def describe(self) -> str:
        lines = [f"placement ({self.device}, {'colocated' if self.colocate else 'separate'}): "
                 f"{len(self.bundles)} bundles, needs {_fmt(self.required.get('GPU', 0))} GPU / "
                 f"{_fmt(self.required.get('CPU', 0))} CPU"]
        for a in self.engines + self.policy:
            share = f", shares GPUs of policy ranks {list(a.shares_gpus_with)}" if a.shares_gpus_with else ""
            lines.append(f"  {a.role} {a.index}: bundle {a.bundle_index} {self.bundles[a.bundle_index]} "
                         f"(actor num_cpus={_fmt(a.num_cpus)}, num_gpus={_fmt(a.num_gpus)}{share})")
        return "\n".join(lines)


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def build_plan(req: PlacementRequest) -> PlacementPlan:
    """The bundle plan of a validated request (config/validation.py checks the layout's consistency)."""
    n_eng, tp, n_pol = req.num_engines, req.engine_workers, req.policy_workers
    ce, cw = float(req.cpus_per_engine), float(req.cpus_per_policy_worker)
    gpu = req.gpus_per_engine > 0
    bundles: list[dict[str, float]] = []
    engines: list[ActorPlacement] = []
    policy: list[ActorPlacement] = []
    if gpu and req.colocate:
        for e in range(n_eng):
            ranks = tuple(range(e * tp, (e + 1) * tp))
            bundles.append({"CPU": ce + tp * cw, "GPU": float(tp)})
            engines.append(ActorPlacement("engine", e, e, ce, 0.0, shares_gpus_with=ranks))
            policy += [ActorPlacement("policy", r, e, cw, 1.0) for r in ranks]
    else:
        ge = float(tp) if gpu else 0.0
        gw = 1.0 if gpu else 0.0
        for e in range(n_eng):
            bundles.append(_bundle(ce, ge))
            engines.append(ActorPlacement("engine", e, e, ce, ge))
        for r in range(n_pol):
            bundles.append(_bundle(cw, gw))
            policy.append(ActorPlacement("policy", r, n_eng + r, cw, gw))
    required = {"CPU": sum(b.get("CPU", 0.0) for b in bundles), "GPU": sum(b.get("GPU", 0.0) for b in bundles)}
    return PlacementPlan("gpu" if gpu else "cpu", bool(gpu and req.colocate), tuple(bundles), "PACK",
                         tuple(engines), tuple(policy), required, req)


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, "GPU": gpus} if gpus > 0 else {"CPU": cpus}


def _breakdown(req: PlacementRequest, plan: PlacementPlan, resource: str) -> str:
    n_eng, tp, n_pol = req.num_engines, req.engine_workers, req.policy_workers
    if resource == "GPU":
        if plan.colocate:
            return (f"{n_pol} for {n_pol} policy workers (tp*pp*cp*dp); the {n_eng} engines x {tp} workers share them")
        return f"{n_eng * tp} for {n_eng} engine(s) x {tp} workers + {n_pol} for {n_pol} policy worker(s)"
    return (f"{_fmt(n_eng * req.cpus_per_engine)} for {n_eng} engine(s) x {_fmt(req.cpus_per_engine)} + "
            f"{_fmt(n_pol * req.cpus_per_policy_worker)} for {n_pol} policy worker(s) x "
            f"{_fmt(req.cpus_per_policy_worker)}")


def plan_placement(plan: PlacementPlan, cluster_resources: Mapping[str, float],
                   node_resources: Sequence[Mapping[str, float]] | None = None) -> PlacementPlan:
    """`plan` (build_plan's) checked against a cluster, or PlacementError saying what is requested vs available.

    cluster_resources: `ray.cluster_resources()`.
    node_resources: optionally the per-node totals (`[n["Resources"] for n in ray.nodes() if n["Alive"]]`);
    given, every bundle must also fit on one node (an engine's TP GPUs cannot span nodes).
    """
    short = []
    for resource in ("GPU", "CPU"):
        need = plan.required.get(resource, 0.0)
        have = float(cluster_resources.get(resource, 0.0))
        if need > have + 1e-9:
            short.append(f"needs {_fmt(need)} {resource}s ({_breakdown(plan.request, plan, resource)}) but the cluster has "
                         f"{_fmt(have)}")
    if short:
        raise PlacementError("cluster too small: " + "; ".join(short))
    if node_resources is not None:
        _check_nodes(plan, [dict(n) for n in node_resources])
    return plan


def _fits(bundle: Mapping[str, float], free: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items() if v > 0)


def _check_nodes(plan: PlacementPlan, nodes: list[dict[str, float]]) -> None:
    if not nodes:
        raise PlacementError("the cluster reports no alive nodes")
    owners = {a.bundle_index: a for a in plan.engines}
    for i, bundle in enumerate(plan.bundles):
        if not any(_fits(bundle, n) for n in nodes):
            largest = max(nodes, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)))
            who = (f"engine {owners[i].index} ({_fmt(bundle.get('GPU', 0))} workers: tensor x pipeline parallel"
                   f"{' with its colocated policy ranks' if plan.colocate else ''})" if i in owners
                   else f"policy rank {next(a.index for a in plan.policy if a.bundle_index == i)}")
            raise PlacementError(
                f"cluster too small: {who} needs {_fmt(bundle.get('GPU', 0))} GPUs and {_fmt(bundle.get('CPU', 0))} "
                f"CPUs on one node, but the largest node has {_fmt(largest.get('GPU', 0))} GPUs and "
                f"{_fmt(largest.get('CPU', 0))} CPUs")
    # First-fit decreasing: the bundles all fit somewhere individually; do they fit together?
    free = [dict(n) for n in nodes]
    order = sorted(range(len(plan.bundles)), key=lambda i: (-plan.bundles[i].get("GPU", 0.0),
                                                             -plan.bundles[i].get("CPU", 0.0)))
    for i in order:
        bundle = plan.bundles[i]
        node = next((n for n in free if _fits(bundle, n)), None)
        if node is None:
            raise PlacementError(
                f"cluster too small: the {len(plan.bundles)} bundles {list(plan.bundles)} do not pack onto the nodes "
                f"{[{k: n.get(k, 0.0) for k in ('GPU', 'CPU')} for n in nodes]} (an engine's GPUs must share a node)")
        for k, v in bundle.items():
            node[k] = node.get(k, 0.0) - v


def actor_options(placement_group: Any, actor: ActorPlacement) -> dict[str, Any]:
    """`.options(**...)` for an actor of the plan inside the placement group created from `plan.bundles`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"num_cpus": actor.num_cpus, "num_gpus": actor.num_gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=actor.bundle_index)}


def reserve(plan: PlacementPlan, timeout_s: float = 300.0) -> Any:
    """Create the plan's placement group and wait until Ray has reserved every bundle.

    Raises PlacementError with the bundles when they are not all reserved within `timeout_s` (another
    job holds the resources, or a node went away); the half-made group is removed first."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(list(plan.bundles), strategy=plan.strategy)
    if not pg.wait(timeout_seconds=timeout_s):
        remove_placement_group(pg)
        raise PlacementError(f"the placement group of {len(plan.bundles)} bundles {list(plan.bundles)} "
                             f"(strategy {plan.strategy}) was not reserved within {timeout_s:.0f}s; other jobs "
                             "may hold those resources")
    return pg


def release(placement_group: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(placement_group)


def plan_for_running_cluster(plan: PlacementPlan) -> PlacementPlan:
    """`plan_placement` against the Ray session this process is connected to (call after ray.init)."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    return plan_placement(plan, ray.cluster_resources(), nodes)
