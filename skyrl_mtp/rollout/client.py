"""`EngineClient`: the driver's handle on N `InferenceEngine` actors.

It validates requests before they reach an engine, spreads prompts over engines (least-loaded,
counted in sequences in flight), owns the acceptance metrics window (counters summed over engines),
and the engines' side of the weight sync: what a sync carries, the colocation sleep/wake calls, and a
driver-side push of weights held in memory (tests, CPU) through the same vLLM weight-transfer calls
the policy's ranks make every step (weight_sync/policy_link.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from skyrl_mtp.rollout.config import (
    EngineConfig,
    GuaranteeWarning,
    check_checkpoint,
    check_engine_kwargs_known,
    unkept_guarantees,
)
from skyrl_mtp.rollout.engine import InferenceEngine
from skyrl_mtp.rollout.sampling import GenerationOutput, SamplingSpec, validate_prompts
from skyrl_mtp.rollout.spec_metrics import SpecCounters, SpecMetricsWindow, sum_counters
from skyrl_mtp.weight_sync.registration import CPU_BACKEND
from skyrl_mtp.weight_sync.schema import WeightSchema

logger = logging.getLogger(__name__)

# vLLM's sleep level for colocated engines: 2 drops the weights too (not offloaded to host memory), since
# every sync rewrites all of them; then wake "weights", sync, wake "kv_cache" (vLLM's documented RL order).


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
        self.last_sync_stats: dict[str, float] = {}
        self._driver_sender: Any = None
        self._dispatched = 0            # generate calls dispatched so far
        self._in_flight = 0             # of them, not yet returned
        # the engines' counters summed, and `_dispatched` when read: they hold until the next dispatch
        self._counters: tuple[int, SpecCounters] | None = None
        self._pending_read: _PendingRead | None = None
        self.metrics = SpecMetricsWindow(self._scrape_counters, cfg.num_speculative_tokens,
                                         snapshot_later=self._scrape_counters_later)

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
            check_runners(cfg, infos)
        except BaseException:
            _stop_actors(actors)
            raise
        for warning in unkept_guarantees(cfg, [i["draft_invariant_sampling"] for i in infos]):
            logger.warning(warning)
            warnings.warn(warning, GuaranteeWarning, stacklevel=2)
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
        self._complete_pending_read()   # a read started before this dispatch reads the counters before it
        self._dispatched += 1
        self._in_flight += 1
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
        self._in_flight -= 1
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

    @property
    def sync_parts(self) -> list[str]:
        """A sync pushes the main model, then (engines that draft) the MTP drafter."""
        return ["main", "draft"] if self.cfg.num_speculative_tokens > 0 else ["main"]

    @property
    def transfer_world_size(self) -> int:
        """The transfer group: the sender (rank 0) and every worker of every engine."""
        return 1 + self.num_engines * self.cfg.workers_per_engine

    def release_driver_sender(self) -> None:
        if self._driver_sender is not None:
            self._driver_sender.shutdown()
            self._driver_sender = None

    def sync_weights(self, named_tensors: Mapping[str, torch.Tensor],
                     parts: list[str] | None = None) -> dict[str, float]:
        """Push weights held in this process (an HF-named dict) to every engine, main model and drafter, through
        vLLM's weight-transfer API with this process as the trainer side, then reset the prefix caches.

        CPU transport only (the policy's ranks send on GPU clusters). Checked before anything moves: a refused
        update raises WeightSyncError naming the tensor and the engines keep their weights. `parts`: as in
        `push_weights`."""
        t0 = time.perf_counter()
        stats = self.push_weights(named_tensors, parts)
        self.reset_prefix_cache()
        self.last_sync_seconds = time.perf_counter() - t0
        self.last_sync_stats = stats
        return stats

    def push_weights(self, named_tensors: Mapping[str, torch.Tensor],
                     parts: list[str] | None = None) -> dict[str, float]:
        """`sync_weights` without the prefix-cache reset (for a caller that orders it, e.g. StepSync);
        `parts` (e.g. ["main"]): push only these, the engines keep the rest."""
        import ray

        from skyrl_mtp.weight_sync.sources import DictWeightSource

        if not isinstance(named_tensors, Mapping) or not named_tensors:
            raise ValueError(f"named_tensors must be a non-empty dict of HF name -> tensor, got "
                             f"{type(named_tensors).__name__}")
        if self.cfg.weight_transfer_backend != CPU_BACKEND:
            raise RuntimeError(f"EngineClient.sync_weights pushes from the driver over the {CPU_BACKEND!r} transport; "
                               f"these engines use {self.cfg.weight_transfer_backend!r}: sync from the policy's ranks "
                               "(PolicyEngineLink)")
        sources = {part: DictWeightSource(named_tensors, part) for part in self.sync_parts}
        if self._driver_sender is None:
            from skyrl_mtp.net import listening_socket
            from skyrl_mtp.weight_sync.engine_actors_client import EngineActorsClient
            from skyrl_mtp.weight_sync.sender import WeightSender
            from skyrl_mtp.weight_sync.transport import trainer_init_info

            addr = ray.util.get_node_ip_address()
            sock = listening_socket(addr)
            info = trainer_init_info(CPU_BACKEND, rank=0, master_address=addr, master_port=sock.getsockname()[1],
                                     world_size=self.transfer_world_size, listen_socket=sock)
            self._driver_sender = WeightSender(info, EngineActorsClient(self._actors, self.cfg.workers_per_engine),
                                               sources, self.sync_parts, self.schema, self.cfg.dtype)
        return self._driver_sender.push(sources, parts=parts)

    def reset_prefix_cache(self) -> None:
        import ray

        ray.get([a.reset_prefix_cache.remote() for a in self._actors])

    def pause_generation(self) -> None:
        """Every engine stops scheduling and keeps its requests (InferenceEngine.pause_generation): a weight sync
        may then run under them. Generate calls in flight stay in flight until `resume_generation`."""
        import ray

        ray.get([a.pause_generation.remote() for a in self._actors])

    def resume_generation(self, weight_version: int) -> None:
        """Label the engines' weights `weight_version` (their tokens from here on carry it) and resume every
        engine; on engines that are not paused it only labels."""
        import ray

        ray.get([a.resume_generation.remote(int(weight_version)) for a in self._actors])

    def sleep(self, level: int) -> None:
        """Colocation: release the engines' GPU memory while the policy trains (a no-op in vLLM's CPU worker)."""
        import ray

        ray.get([a.sleep.remote(level) for a in self._actors])

    def wake_up(self, tags: list[str]) -> None:
        """Colocation: wake ["weights"] before a sync, ["kv_cache"] after it."""
        import ray

        ray.get([a.wake_up.remote(list(tags)) for a in self._actors])

    def weight_digests(self) -> list[dict[str, str]]:
        """Per engine: sha256 of every parameter and buffer of its target model and MTP drafter (worker 0)."""
        import ray

        return ray.get([a.weight_digest.remote() for a in self._actors])

    def lifecycle(self) -> list[list[tuple]]:
        """Each engine's sync/sleep calls into vLLM, in order."""
        import ray

        return ray.get([a.lifecycle.remote() for a in self._actors])

    # ---- metrics / lifecycle -------------------------------------------------------------

    def per_engine_counters(self) -> list[SpecCounters]:
        """Cumulative counters of each engine (the metrics window sums these)."""
        import ray

        return ray.get(self._start_engine_reads())

    def _scrape_counters(self) -> SpecCounters:
        """The engines' counters summed (the metrics window's snapshot). An engine's counters change only
        while it generates, so a read taken with nothing in flight holds until the next dispatch: a window
        that reopens with nothing generated since (resumed after the rewards, started after training) reuses
        it instead of a round trip to every engine."""
        self._complete_pending_read()
        if self._counters is not None and self._counters[0] == self._dispatched and not self._in_flight:
            return self._counters[1]
        dispatched, idle = self._dispatched, not self._in_flight
        counters = self._finish_engine_reads(self._start_engine_reads())
        self._keep_counters(dispatched, idle, counters)
        return counters

    def _scrape_counters_later(self) -> Callable[[], SpecCounters]:
        """Start the window's snapshot at a pause and return what completes it: the engines read their
        counters while the driver computes the rewards, and the next dispatch (or read) waits for that read
        first, so it holds the counters as they were at the pause. With generate calls in flight it reads
        at once (what it would read later depends on when)."""
        self._complete_pending_read()
        if (self._counters is not None and self._counters[0] == self._dispatched) or self._in_flight:
            counters = self._scrape_counters()
            return lambda: counters
        pending = self._pending_read = _PendingRead(self._dispatched, self._start_engine_reads())
        return lambda: self._complete(pending)

    def _complete_pending_read(self) -> None:
        if self._pending_read is not None:
            self._complete(self._pending_read)

    def _complete(self, pending: _PendingRead) -> SpecCounters:
        if pending.counters is None:
            if self._pending_read is pending:
                self._pending_read = None
            pending.counters = self._finish_engine_reads(pending.refs)
            self._keep_counters(pending.dispatched, True, pending.counters)
        return pending.counters

    def _keep_counters(self, dispatched: int, idle_before: bool, counters: SpecCounters) -> None:
        """Keep a read for reuse if nothing was in flight before or after it, and nothing dispatched meanwhile."""
        if idle_before and not self._in_flight and self._dispatched == dispatched:
            self._counters = (dispatched, counters)

    def _start_engine_reads(self) -> list[Any]:
        return [a.spec_counters.remote() for a in self._actors]

    def _finish_engine_reads(self, refs: list[Any]) -> SpecCounters:
        import ray

        return sum_counters(ray.get(refs))

    def shutdown(self) -> None:
        self.release_driver_sender()
        _stop_actors(self._actors)
        self._actors = []


@dataclasses.dataclass
class _PendingRead:
    """A read of every engine's counters started at `dispatched` dispatches (ray refs), and its sum once read."""

    dispatched: int
    refs: list[Any]
    counters: SpecCounters | None = None


def check_runners(cfg: EngineConfig, infos: list[dict[str, Any]]) -> None:
    """Every engine runs the model runner its config chose (read from its workers, not from the config)."""
    ran = [i.get("model_runner") for i in infos]
    wrong = [(i, r) for i, r in enumerate(ran) if r != cfg.model_runner]
    if wrong:
        raise RuntimeError(f"engines {[i for i, _ in wrong]} run vLLM's model runner {sorted({r for _, r in wrong})}, "
                           f"not EngineConfig.model_runner={cfg.model_runner!r} (generator.model_runner): vLLM "
                           "overrode VLLM_USE_V2_MODEL_RUNNER (config/vllm.py use_v2_model_runner)")


def _stop_actors(actors: list[Any]) -> None:
    """Shut vLLM down inside each actor first (a bare kill leaks shared memory), then kill the actor."""
    import ray

    for a in actors:
        try:
            ray.get(a.shutdown.remote(), timeout=60)
        except Exception:
            pass
        ray.kill(a)
