"""The engine-core half of MTP drafting under pipeline parallelism: drafts reach the scheduler in step order.

With PP > 1 vLLM's engine core keeps several batches in flight (`EngineCore.step_with_batch_queue`) and, after
scheduling each one, fetches the drafts of the batch the last stage just sampled (`post_step` ->
`take_draft_token_ids`), BEFORE that batch's output has been applied (`update_from_output`). vLLM's
`Scheduler.update_draft_token_ids` installs them at once, so a request whose step is still in flight shows
drafts but not the token they follow. Right after a prefill this makes the next schedule() send the request
its k drafts alone (`num_tokens_with_spec - num_computed_tokens = k`), without the sampled token: the stages
then compute garbage positions, and vLLM's non-last stages crash on the empty `new_token_ids`
(gpu_model_runner._update_states). Without PP the order is the other one (output, then drafts).

`PipelineParallelDraftScheduler` restores that order: drafts for a request whose batch is still in flight are
held and installed right after that batch's output is applied. A request can be in several in-flight batches at
once: under chunked prefill (vLLM's default on GPUs) the scheduler sends a prompt's next chunk while the previous
one is still in the pipeline (`_update_after_schedule` advances `num_computed_tokens` at schedule time). The
scheduler therefore counts, per request, the in-flight batches that hold it, and installs held drafts only when
the last of them has come back: the drafts always follow the output of the batch that proposed them.
Everything else is vLLM's `Scheduler`.
Installed with the engine argument `scheduler_cls` (rollout/config.py) for engines with
pipeline_parallel_size > 1; the worker half is vllm_patches/pipeline_parallel.py. The engine passes the class itself, not
its name (engine.py): vLLM's EngineCore process unpickles it with the engine's config, before it re-validates
that config, which with PP > 1 inspects the model's architecture (`ModelConfig.verify_with_parallel_config`).
Importing this module therefore makes the served family's vLLM model code importable in that process first
(models.families.prepare_vllm_worker: Qwen3.5's import shim where torchvision is absent), as the worker
extension does in the workers.
"""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from skyrl_mtp import engine_process
from skyrl_mtp.models.families import prepare_vllm_worker

# in the EngineCore process, before it inspects the architecture (see the docstring)
prepare_vllm_worker(engine_process.current().model_family)

# overridden method -> the leading parameters it must still have
OVERRIDDEN = {"schedule": ("self",), "update_from_output": ("self", "scheduler_output", "model_runner_output"),
              "update_draft_token_ids": ("self", "draft_token_ids")}


class PipelineParallelSchedulerError(RuntimeError):
    """vLLM's Scheduler changed where this subclass overrides it."""


def check_scheduler(cls: type = Scheduler) -> None:
    for name, params in OVERRIDDEN.items():
        fn = getattr(cls, name, None)
        if not callable(fn):
            raise PipelineParallelSchedulerError(f"vllm Scheduler.{name} is gone; skyrl_mtp's pipeline-parallel "
                                                 "scheduler must be updated for this vLLM version")
        have = tuple(inspect.signature(fn).parameters)[:len(params)]
        if have != params:
            raise PipelineParallelSchedulerError(f"vllm Scheduler.{name} takes {have}, expected {params} first; "
                                                 "skyrl_mtp's pipeline-parallel scheduler must be updated")


check_scheduler()


class PipelineParallelDraftScheduler(Scheduler):
    """vLLM's synchronous scheduler, with drafts installed after the output of the batch that proposed them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.scheduler_config.async_scheduling or getattr(self.vllm_config, "use_v2_model_runner", False):
            raise PipelineParallelSchedulerError(
                "skyrl_mtp's pipeline-parallel draft scheduler covers vLLM's V1 model runner with synchronous "
                "scheduling (vLLM's choice for V1 with pipeline parallelism); this engine runs "
                f"{'the V2 runner' if getattr(self.vllm_config, 'use_v2_model_runner', False) else 'async scheduling'}"
                ": on GPUs set VLLM_USE_V2_MODEL_RUNNER=0")
        self._in_flight: Counter[str] = Counter()   # request id -> in-flight batches that hold it
        self._held: dict[str, list[int]] = {}
        self.held_draft_sets = 0   # drafts that arrived while their request's batch was in flight

    def schedule(self, *args: Any, **kwargs: Any):
        out = super().schedule(*args, **kwargs)
        self._in_flight.update(out.num_scheduled_tokens.keys())
        return out

    def update_from_output(self, scheduler_output, model_runner_output, *args: Any, **kwargs: Any):
        outputs = super().update_from_output(scheduler_output, model_runner_output, *args, **kwargs)
        done = []   # requests with no batch left in flight
        for r in scheduler_output.num_scheduled_tokens:
            if self._in_flight[r] > 1:
                self._in_flight[r] -= 1
            else:
                self._in_flight.pop(r, None)
                done.append(r)
        ready = [r for r in done if r in self._held]
        if ready:
            from vllm.v1.outputs import DraftTokenIds

            super().update_draft_token_ids(DraftTokenIds(ready, [self._held.pop(r) for r in ready]))
        return outputs

    def update_draft_token_ids(self, draft_token_ids, *args: Any, **kwargs: Any) -> None:
        from vllm.v1.outputs import DraftTokenIds

        now_ids, now_drafts = [], []
        for rid, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            if rid in self._in_flight:
                self._held[rid] = list(drafts)
                self.held_draft_sets += 1
            else:
                now_ids.append(rid)
                now_drafts.append(drafts)
        if now_ids:
            super().update_draft_token_ids(DraftTokenIds(now_ids, now_drafts), *args, **kwargs)
