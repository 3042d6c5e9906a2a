"""`EngineClient`: the driver's handle on N `InferenceEngine` actors.

It validates requests before they reach an engine, spreads prompts over engines (least-loaded,
counted in sequences in flight), pushes weight updates to every engine (after checking them
against the engines' weight schema, so a bad update changes nothing), and owns the acceptance
metrics window, whose counters it sums over engines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from skyrl_mtp.rollout.config import EngineConfig, check_checkpoint, check_engine_kwargs_known
from skyrl_mtp.rollout.engine import InferenceEngine
from skyrl_mtp.rollout.sampling import GenerationOutput, SamplingSpec, validate_prompts
from skyrl_mtp.rollout.spec_metrics import SpecCounters, SpecMetricsWindow, sum_counters
from skyrl_mtp.rollout.weight_sync import (
    NcclGroupLayout,
    WeightSchema,
    describe_tensors,
    drafter_subset,
    nccl_group_layout,
    serialize_weights,
    validate_update,
)


def assign_least_loaded(num_items: int, loads: list[int], weight: int = 1) -> list[int]:
    """Engine index for each of `num_items` items: each goes to the currently least-loaded engine
    (ties -> lowest index); `loads` is not modified."""
    if not loads:
        raise ValueError("assign_least_loaded needs at least one engine")
    current = list(loads)
    out = []
    for _ in range(num_items):
        e = min(range(len(current)), key=lambda i: (current[i], i))
        out.append(e)
        current[e] += weight
    return out


def known_engine_args() -> set[str]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return {f.name for f in dataclasses.fields(AsyncEngineArgs)}


class EngineClient:
    """Create with `EngineClient.create(cfg)`; always `shutdown()` (engines hold processes and shared memory)."""

    def __init__(self, cfg: EngineConfig, actors: list[Any], infos: list[dict[str, Any]]):
        self.cfg = cfg
        self._actors = actors
        self.schema: WeightSchema = infos[0]["schema"]
        self.vocab_size: int = int(infos[0]["vocab_size"])
        self.engine_infos = infos
        self._loads = [0] * len(actors)
        self.last_sync_seconds: float | None = None
        self.metrics = SpecMetricsWindow(self._scrape_counters, cfg.num_speculative_tokens)

    @classmethod
    def create(cls, cfg: EngineConfig, *, num_cpus_per_engine: float = 1, num_gpus_per_engine: float = 0,
               actor_options: Mapping[str, Any] | None = None,
               per_engine_options: Sequence[Mapping[str, Any]] | None = None) -> EngineClient:
        """Validate `cfg` against the checkpoint, start `cfg.num_engines` actors and wait until all serve.

        `per_engine_options[i]` (e.g. engine i's placement-group bundle) goes on top of `actor_options`."""
        import ray

        if not isinstance(cfg, EngineConfig):
            raise TypeError(f"cfg must be an EngineConfig, got {type(cfg).__name__}")
        check_checkpoint(cfg)
        if cfg.engine_kwargs:
            check_engine_kwargs_known(cfg.engine_kwargs, known_engine_args())
        if not ray.is_initialized():
            raise RuntimeError("EngineClient.create needs a running Ray session (ray.init first)")
        if per_engine_options is not None and len(per_engine_options) != cfg.num_engines:
            raise ValueError(f"per_engine_options has {len(per_engine_options)} entries for "
                             f"num_engines={cfg.num_engines}; give one per engine")
        options = {"num_cpus": num_cpus_per_engine, "num_gpus": num_gpus_per_engine, **(actor_options or {})}
        actor_cls = ray.remote(InferenceEngine)
        actors = [actor_cls.options(**{**options, **(per_engine_options[i] if per_engine_options else {})}).remote(cfg, i)
                  for i in range(cfg.num_engines)]
        try:
            infos = ray.get([a.ready.remote() for a in actors])
        except BaseException:
            _stop_actors(actors)
            raise
        return cls(cfg, actors, infos)

    @property
    def actors(self) -> list[Any]:
        return list(self._actors)

    def running_speculative_tokens(self) -> list[int]:
        """num_speculative_tokens each engine's vLLM config actually holds (0 = no speculative decoding)."""
        import ray

        def k_of(engine: Any) -> int:
            spec = engine._engine.vllm_config.speculative_config
            return 0 if spec is None else int(spec.num_speculative_tokens)

        return ray.get([a.__ray_call__.remote(k_of) for a in self._actors])

    @property
    def num_engines(self) -> int:
        return len(self._actors)

    # ---- generation ----------------------------------------------------------------------

    def _dispatch(self, prompts: list[list[int]], sampling: SamplingSpec):
        if not isinstance(sampling, SamplingSpec):
            raise TypeError(f"sampling must be a SamplingSpec, got {type(sampling).__name__}")
        sampling = dataclasses.replace(sampling)   # re-validates fields changed after construction
        validate_prompts(prompts, self.vocab_size, self.cfg.max_model_len)
        engines = assign_least_loaded(len(prompts), self._loads, sampling.n)
        calls = []
        for e in range(self.num_engines):
            idx = [i for i, eng in enumerate(engines) if eng == e]
            if idx:
                ref = self._actors[e].generate.remote([list(prompts[i]) for i in idx], sampling, idx)
                calls.append((e, idx, ref))
                self._loads[e] += len(idx) * sampling.n
        return sampling, calls

    def _collect(self, num_prompts: int, n: int, calls, results) -> list[GenerationOutput]:
        per_prompt: list[list[GenerationOutput] | None] = [None] * num_prompts
        for (_, idx, _), res in zip(calls, results):
            for i, outs in zip(idx, res):
                per_prompt[i] = outs
        return [o for outs in per_prompt for o in outs]

    def _release(self, calls, n: int) -> None:
        for e, idx, _ in calls:
            self._loads[e] -= len(idx) * n

    async def generate(self, prompts: list[list[int]], sampling: SamplingSpec) -> list[GenerationOutput]:
        """`sampling.n` outputs per prompt, prompt-major: outputs[i * n + j] is sample j of prompt i."""
        sampling, calls = self._dispatch(prompts, sampling)
        try:
            results = await asyncio.gather(*(ref for _, _, ref in calls))
        finally:
            self._release(calls, sampling.n)
        return self._collect(len(prompts), sampling.n, calls, results)

    def generate_sync(self, prompts: list[list[int]], sampling: SamplingSpec) -> list[GenerationOutput]:
        """Blocking `generate` (no event loop needed)."""
        import ray

        sampling, calls = self._dispatch(prompts, sampling)
        try:
            results = ray.get([ref for _, _, ref in calls])
        finally:
            self._release(calls, sampling.n)
        return self._collect(len(prompts), sampling.n, calls, results)

    # ---- weight sync ---------------------------------------------------------------------

    def validate_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        if not isinstance(named_tensors, Mapping) or not named_tensors:
            raise ValueError(f"named_tensors must be a non-empty dict of HF name -> tensor, got "
                             f"{type(named_tensors).__name__}")
        validate_update(describe_tensors(named_tensors), self.schema, self.cfg.dtype, self._optional_names())

    def _optional_names(self) -> list[str]:
        """Without a drafter the engine does not serve the MTP head: a policy that has none may omit it."""
        return drafter_subset(list(self.schema)) if self.cfg.num_speculative_tokens == 0 else []

    def sync_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Reload main model AND MTP drafter on every engine, then reset their prefix caches (CPU path).

        The update is checked against the engines' weights first; if it is rejected nothing changes.
        """
        import ray

        self.validate_weights(named_tensors)
        t0 = time.perf_counter()
        blob_ref = ray.put(serialize_weights(named_tensors))
        ray.get([a.load_weights_bytes.remote(blob_ref) for a in self._actors])
        self.last_sync_seconds = time.perf_counter() - t0

    def begin_nccl_group(self, master_addr: str, master_port: int) -> tuple[NcclGroupLayout, list[Any]]:
        """Start every engine worker joining the weight-update group (GPU path).

        Returns the layout (rank 0 = the sender, `layout.world_size` ranks) and the engines' pending
        join calls: build `NcclWeightSender(master_addr, master_port, layout.world_size)` in the policy's
        rank-0 process, then `ray.get` the returned refs.
        """
        layout = nccl_group_layout([self.cfg.tensor_parallel_size] * self.num_engines)
        refs = [a.init_nccl_group.remote(master_addr, master_port, off, layout.world_size)
                for a, off in zip(self._actors, layout.engine_rank_offsets)]
        return layout, refs

    def sync_weights_nccl(self, plan: list[tuple[str, list[int], str]], send: Callable[[], Any]) -> None:
        """GPU path: engines receive `plan` (weight_sync.broadcast_plan of the sender's tensors) while
        `send()` makes rank 0 broadcast them; then main model and drafter are reloaded and caches reset."""
        import ray

        validate_update({name: (tuple(shape), dtype) for name, shape, dtype in plan}, self.schema, self.cfg.dtype,
                        self._optional_names())
        t0 = time.perf_counter()
        refs = [a.receive_weights_nccl.remote(plan) for a in self._actors]
        send()
        ray.get(refs)
        self.last_sync_seconds = time.perf_counter() - t0

    def reset_prefix_cache(self) -> None:
        import ray

        ray.get([a.reset_prefix_cache.remote() for a in self._actors])

    # ---- metrics / lifecycle -------------------------------------------------------------

    def per_engine_counters(self) -> list[SpecCounters]:
        """Cumulative counters of each engine (the metrics window sums these)."""
        import ray

        return ray.get([a.spec_counters.remote() for a in self._actors])

    def _scrape_counters(self) -> SpecCounters:
        return sum_counters(self.per_engine_counters())

    def shutdown(self) -> None:
        _stop_actors(self._actors)
        self._actors = []


def _stop_actors(actors: list[Any]) -> None:
    """Shut vLLM down inside each actor first (a bare kill leaks shared memory), then kill the actor."""
    import ray

    for a in actors:
        try:
            ray.get(a.shutdown.remote(), timeout=60)
        except Exception:
            pass
        ray.kill(a)
