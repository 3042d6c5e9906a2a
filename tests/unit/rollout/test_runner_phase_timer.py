"""runner_phase_timer on a stand-in runner: what it counts, what it keeps, when it refuses."""

import inspect
import time

import pytest

from skyrl_mtp.rollout.runner_phase_timer import PHASES, PhaseTimerError, install, ms_per_step


class Runner:
    """The phase methods of vLLM's runner, nested the way vLLM nests them."""

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self._prepare_inputs(scheduler_output)
        return self._model_forward(scheduler_output)

    def _prepare_inputs(self, scheduler_output):
        time.sleep(0.002)

    def _model_forward(self, x):
        time.sleep(0.004)
        return x

    def sample_tokens(self, grammar_output):
        self._sample(grammar_output, None)
        self._bookkeeping_sync(grammar_output)
        return "sampled"

    def _sample(self, logits, spec_decode_metadata):
        return logits

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids):
        return []

    def _bookkeeping_sync(self, scheduler_output):
        return None


def test_counts_nested_phases_per_step_and_keeps_results_and_signatures():
    runner = Runner()
    timer = install(runner)
    before = timer.snapshot()
    for step in range(3):
        assert runner.execute_model(step) == step
        assert runner.sample_tokens(None) == "sampled"
    after = timer.snapshot()
    assert {p: after[p][0] for p in PHASES} == {**{p: 3 for p in PHASES}, "propose_draft_token_ids": 0}
    ms = ms_per_step(before, after)
    assert 2.0 <= ms["_prepare_inputs"] < ms["execute_model"] and 4.0 <= ms["_model_forward"] < ms["execute_model"]
    assert ms["execute_model"] >= ms["_prepare_inputs"] + ms["_model_forward"]
    assert ms["propose_draft_token_ids"] == 0.0
    # adaptive_speculation.check_runner reads these signatures after (or before) the timer wraps them
    assert tuple(inspect.signature(runner._sample).parameters) == ("logits", "spec_decode_metadata")
    assert type(runner).execute_model is Runner.execute_model   # the class is untouched


def test_installing_twice_times_once():
    runner = Runner()
    assert install(runner) is install(runner)
    runner.execute_model(0)
    assert runner._skyrl_phase_timer.snapshot()["execute_model"][0] == 1


def test_a_runner_without_a_phase_is_refused_by_name():
    class Moved(Runner):
        _bookkeeping_sync = None

    with pytest.raises(PhaseTimerError, match="_bookkeeping_sync"):
        install(Moved())


def test_no_step_between_snapshots_is_an_error():
    timer = install(Runner())
    with pytest.raises(ValueError, match="no engine step"):
        ms_per_step(timer.snapshot(), timer.snapshot())
