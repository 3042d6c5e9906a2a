"""The worker half of auto k on a stand-in runner: the drafter skipped at k = 0, which steps run as no-spec steps.

The stand-in follows the contract the hook relies on in vLLM's runner: `execute_model` builds spec-decode
metadata only while `speculative_config` is set, stores it in `execute_model_state`, and `sample_tokens`
reads it back and proposes drafts. The real runner is covered by tests/integration/rollout/test_speculation_engines.py.
"""

from __future__ import annotations

from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch

from skyrl_mtp.speculation.settings import AdaptiveSpeculationError
from skyrl_mtp.speculation.worker_hook import Hook, install, plain_steps_supported

State = namedtuple("State", "scheduler_output spec_decode_metadata spec_decode_common_attn_metadata")
SPEC = object()


class Runner:
    def __init__(self, hybrid: bool = False, async_scheduling: bool = False, ignores_config: bool = False):
        self.speculative_config = SPEC
        self.model_config = SimpleNamespace(is_hybrid=hybrid)
        self.use_async_scheduling = async_scheduling
        self.device = "cpu"
        self.execute_model_state = None
        self.ignores_config = ignores_config
        self.seen: list[tuple[str, bool]] = []     # (method, ran with speculation configured)
        self.proposed: list[int] = []              # the k of each drafter run

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        spec = self.speculative_config is not None or self.ignores_config
        self.seen.append(("execute_model", self.speculative_config is not None))
        if scheduler_output.total_num_scheduled_tokens:
            drafts = [len(d) for d in scheduler_output.scheduled_spec_decode_tokens.values()] or [0]
            meta = SimpleNamespace(num_draft_tokens=drafts) if spec else None
            self.execute_model_state = State(scheduler_output, meta, "attn" if spec else None)
        return None

    def sample_tokens(self, grammar_output):
        self.seen.append(("sample_tokens", self.speculative_config is not None))
        state, self.execute_model_state = self.execute_model_state, None
        if self.speculative_config is not None:
            self.propose_draft_token_ids(state.scheduler_output, torch.zeros(1, 1), None, None, None, None,
                                         state.spec_decode_metadata, state.spec_decode_common_attn_metadata)
        return "output"

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata):
        self.proposed.append(scheduler_output.num_spec_tokens_to_schedule)
        return torch.ones(1, scheduler_output.num_spec_tokens_to_schedule, dtype=torch.int64)

    def take_draft_token_ids(self):
        return None

    def _sample(self, logits, spec_decode_metadata):
        return logits


def _step(runner, drafts: dict, k: int, tokens: int = 1):
    out = SimpleNamespace(scheduled_spec_decode_tokens=drafts, num_spec_tokens_to_schedule=k,
                          num_scheduled_tokens={"r": tokens}, total_num_scheduled_tokens=tokens)
    runner.seen.clear()
    assert runner.execute_model(out, None) is None
    if runner.execute_model_state is not None:
        assert runner.sample_tokens(None) == "output"
    return list(runner.seen)


def test_a_step_with_nothing_to_verify_or_propose_runs_without_speculation():
    runner = Runner()
    hook = Hook(runner, k_max=3)
    assert _step(runner, {}, 0) == [("execute_model", False), ("sample_tokens", False)]
    assert runner.speculative_config is SPEC                          # restored after the step
    assert _step(runner, {}, 2) == [("execute_model", True), ("sample_tokens", True)]     # drafts to propose
    assert _step(runner, {"r": [5, 6]}, 0) == [("execute_model", True), ("sample_tokens", True)]  # to verify
    assert _step(runner, {}, 0, tokens=0) == [("execute_model", False)]   # empty step: no sample_tokens
    assert _step(runner, {}, 0) == [("execute_model", False), ("sample_tokens", False)]
    stats = hook.stats()
    assert stats["plain_steps"] == 2
    assert stats["k_histogram"] == [3, 0, 1, 0]           # the empty step has no k; the rest counted once
    assert stats["skipped_drafter_steps"] == 3
    assert runner.proposed == [2]                          # the drafter ran at k = 2 only, never at k = 0


@pytest.mark.parametrize("kw, why", [({"hybrid": True}, "hybrid"), ({"async_scheduling": True}, "async")])
def test_recurrent_models_and_async_scheduling_keep_the_speculative_path(kw, why):
    runner = Runner(**kw)
    ok, reason = plain_steps_supported(runner)
    assert not ok and why in reason
    hook = Hook(runner, k_max=3)
    assert _step(runner, {}, 0) == [("execute_model", True), ("sample_tokens", True)]
    assert hook.stats()["plain_steps"] == 0 and hook.stats()["skipped_drafter_steps"] == 1
    assert runner.proposed == []   # the speculative path, but still no drafter at k = 0


def test_a_runner_that_builds_metadata_without_a_speculative_config_fails_loudly():
    runner = Runner(ignores_config=True)
    Hook(runner, k_max=3)
    with pytest.raises(AdaptiveSpeculationError, match="still built spec_decode_metadata"):
        _step(runner, {}, 0)
    assert runner.speculative_config is SPEC


def test_the_wrappers_keep_the_runner_signatures():
    import inspect

    runner = Runner()
    sig = inspect.signature(runner.execute_model), inspect.signature(runner.sample_tokens)
    Hook(runner, k_max=3)
    assert (inspect.signature(runner.execute_model), inspect.signature(runner.sample_tokens)) == sig


def test_the_pinned_vllm_runner_has_what_the_hook_wraps():
    """check_runner's signature checks hold on the vLLM this project pins (the CPU runner is the GPU one's)."""
    import inspect

    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from skyrl_mtp.speculation.worker_hook import PROPOSE_PARAMS

    propose = tuple(inspect.signature(CPUModelRunner.propose_draft_token_ids).parameters)[1:]
    assert propose[:len(PROPOSE_PARAMS)] == PROPOSE_PARAMS


def test_install_fails_loudly_when_vllm_moved():
    class Moved:   # no propose_draft_token_ids
        def execute_model(self, scheduler_output):
            return None

    with pytest.raises(AdaptiveSpeculationError, match="propose_draft_token_ids"):
        install(Moved())


def test_the_worker_accepts_the_adaptive_scheduler_or_a_subclass_and_nothing_else():
    import sys
    import types

    from skyrl_mtp.speculation.scheduler_hook import AdaptiveSpeculationScheduler
    from skyrl_mtp.speculation.settings import SCHEDULER_CLS
    from skyrl_mtp.speculation.worker_hook import is_adaptive_scheduler

    module = types.ModuleType("skyrl_test_schedulers")
    module.Timed = type("Timed", (AdaptiveSpeculationScheduler,), {})
    module.Other = type("Other", (), {})
    sys.modules[module.__name__] = module
    try:
        assert is_adaptive_scheduler(SCHEDULER_CLS) and is_adaptive_scheduler(AdaptiveSpeculationScheduler)
        assert is_adaptive_scheduler("skyrl_test_schedulers.Timed") and is_adaptive_scheduler(module.Timed)
        for other in ("skyrl_test_schedulers.Other", "vllm.v1.core.sched.scheduler.Scheduler", "no_such.Module",
                      "skyrl_test_schedulers.Missing", None, "Scheduler"):
            assert not is_adaptive_scheduler(other), other
    finally:
        del sys.modules[module.__name__]
