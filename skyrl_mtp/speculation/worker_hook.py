"""The worker half of auto k: vLLM's model runner follows the k the engine core's scheduler chose.

Why this exists: vLLM's dynamic speculative decoding hands each step's k to the runner
(`SchedulerOutput.num_spec_tokens_to_schedule`), but its V1 runner still runs the drafter at k = 0. Here a
step at k = 0 proposes nothing (the drafter does not run), and a step with nothing to verify and nothing to
propose runs as vLLM's no-spec step (its runner skips the speculative bookkeeping when
`speculative_config` is None), so an engine that stopped drafting costs what one built without speculation
costs. That second part needs synchronous scheduling and an attention-only model (vLLM keeps zero-draft
rows speculative for recurrent ones); elsewhere such steps keep the speculative path.

`install(runner)` checks every name it relies on and raises AdaptiveSpeculationError naming what moved; it
wraps the runner instance's methods (the class is untouched). The worker extension calls it.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

from skyrl_mtp.speculation.settings import SCHEDULER_CLS, AdaptiveSpeculationError, require

logger = logging.getLogger(__name__)

PROPOSE_PARAMS = ("scheduler_output", "sampled_token_ids")   # the leading ones: read here, the rest passed on
STATE_FIELDS = ("spec_decode_metadata", "spec_decode_common_attn_metadata")


def _params(fn: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def check_runner(runner: Any) -> None:
    """Every name the hook relies on, checked before anything is wrapped."""
    from dataclasses import fields

    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_model_runner import ExecuteModelState

    name = type(runner).__name__
    for attr in ("propose_draft_token_ids", "speculative_config", "device", "execute_model", "sample_tokens",
                 "execute_model_state"):
        require(hasattr(runner, attr), f"model runner {name} has no `{attr}`")
    got = _params(runner.propose_draft_token_ids)
    require(got[:len(PROPOSE_PARAMS)] == PROPOSE_PARAMS,
            f"{name}.propose_draft_token_ids parameters are {got}, expected them to start with {PROPOSE_PARAMS}")
    out_fields = {f.name for f in fields(SchedulerOutput)}
    for f in ("num_spec_tokens_to_schedule", "scheduled_spec_decode_tokens"):
        require(f in out_fields, f"SchedulerOutput has no field {f}")
    missing = set(STATE_FIELDS) - set(ExecuteModelState._fields)
    require(not missing, f"ExecuteModelState has no field(s) {sorted(missing)}")
    par = getattr(runner, "parallel_config", None)
    world = 1 if par is None else par.tensor_parallel_size * par.pipeline_parallel_size * par.data_parallel_size
    if world != 1:
        raise AdaptiveSpeculationError(f"auto k supports one worker per engine (tp=pp=dp=1), got {world} ranks; "
                                       "set trainer.mtp.num_speculative_tokens to an int")
    spec = runner.speculative_config
    require(spec is not None and getattr(spec, "num_speculative_tokens_per_batch_size", None),
            "the engine was built without num_speculative_tokens_per_batch_size (dynamic speculative decoding)")
    got = getattr(getattr(getattr(runner, "vllm_config", None), "scheduler_config", None), "scheduler_cls", None)
    if not is_adaptive_scheduler(got):   # without the engine-core half, k would stay k_max
        raise AdaptiveSpeculationError(f"the engine's scheduler_cls is {got!r}; auto k needs {SCHEDULER_CLS!r} "
                                       "or a subclass (EngineConfig(adaptive_speculation=True) sets it)")


def is_adaptive_scheduler(cls: Any) -> bool:
    """vLLM's scheduler_cls (a class or its qualified name) is the adaptive scheduler or a subclass of it."""
    import importlib

    from skyrl_mtp.speculation.scheduler_hook import AdaptiveSpeculationScheduler

    if isinstance(cls, str) and "." in cls:
        module, _, name = cls.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return False
    return isinstance(cls, type) and issubclass(cls, AdaptiveSpeculationScheduler)


def plain_steps_supported(runner: Any) -> tuple[bool, str]:
    """Can a step with no drafts either way run as a no-spec step on this runner? (and if not, why)"""
    if getattr(runner, "use_async_scheduling", True):
        return False, "async scheduling carries draft state between steps"
    if getattr(getattr(runner, "model_config", None), "is_hybrid", True):
        return False, "a hybrid (recurrent) model keeps zero-draft decode rows speculative"
    return True, ""


class Hook:
    """Wraps one runner: k = 0 proposes nothing; nothing to verify or propose runs as a no-spec step."""

    def __init__(self, runner: Any, k_max: int):
        import torch

        self.runner, self.k_max = runner, k_max
        self.histogram = [0] * (k_max + 1)
        self.skipped_drafter = self.plain_steps = 0
        self.plain_supported, self.plain_unsupported_why = plain_steps_supported(runner)
        self._plain_pending = False
        propose, execute, sample = runner.propose_draft_token_ids, runner.execute_model, runner.sample_tokens

        @functools.wraps(propose)
        def propose_draft_token_ids(scheduler_output, sampled_token_ids, *args, **kwargs):
            if self._count_k(scheduler_output) == 0:   # no drafts wanted: the drafter and its inputs are skipped
                self.skipped_drafter += 1
                return torch.empty(len(scheduler_output.num_scheduled_tokens), 0, dtype=torch.int64,
                                   device=runner.device)
            return propose(scheduler_output, sampled_token_ids, *args, **kwargs)

        @functools.wraps(execute)
        def execute_model(scheduler_output, *args, **kwargs):
            self._plain_pending = False
            if (not self.plain_supported or scheduler_output.scheduled_spec_decode_tokens
                    or scheduler_output.num_spec_tokens_to_schedule):
                return execute(scheduler_output, *args, **kwargs)
            out = self._without_speculation(execute, scheduler_output, *args, **kwargs)
            state = runner.execute_model_state
            if state is None:   # an empty step: no sample_tokens follows
                return out
            for name in STATE_FIELDS:
                require(getattr(state, name) is None, f"with speculative_config=None, {type(runner).__name__}"
                        f".execute_model still built {name}, so a k = 0 step cannot run as a no-spec step")
            self._count_k(scheduler_output)
            self.skipped_drafter += 1
            self.plain_steps += 1
            self._plain_pending = True
            return out

        @functools.wraps(sample)
        def sample_tokens(*args, **kwargs):
            if not self._plain_pending:
                return sample(*args, **kwargs)
            self._plain_pending = False
            return self._without_speculation(sample, *args, **kwargs)

        runner.propose_draft_token_ids = propose_draft_token_ids
        runner.execute_model = execute_model
        runner.sample_tokens = sample_tokens

    def _count_k(self, scheduler_output: Any) -> int:
        k = int(scheduler_output.num_spec_tokens_to_schedule)
        if not 0 <= k <= self.k_max:
            raise AdaptiveSpeculationError(f"the scheduler sent num_spec_tokens_to_schedule={k}, outside 0..{self.k_max}")
        self.histogram[k] += 1
        return k

    def _without_speculation(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        spec, self.runner.speculative_config = self.runner.speculative_config, None
        try:
            return fn(*args, **kwargs)
        finally:
            self.runner.speculative_config = spec

    def stats(self) -> dict[str, Any]:
        return {"steps": sum(self.histogram), "k_histogram": list(self.histogram),
                "skipped_drafter_steps": self.skipped_drafter, "plain_steps": self.plain_steps}


def install(runner: Any) -> Hook:
    """Check the runner, then wrap it (once); k_max is the engine's num_speculative_tokens."""
    hook = getattr(runner, "_skyrl_adaptive_hook", None)
    if hook is None:
        check_runner(runner)
        hook = runner._skyrl_adaptive_hook = Hook(runner, int(runner.speculative_config.num_speculative_tokens))
        if not hook.plain_supported:
            logger.info("skyrl_mtp auto k: steps without drafts keep vLLM's speculative path (%s)",
                        hook.plain_unsupported_why)
    return hook
