"""Closing a failed weight sync on a worker (rollout/worker_session_close.py), with vLLM's own Worker session methods
(start / update / finish, v1/worker/gpu_worker.py) run on a stand-in worker whose weight-transfer engine records
what it is asked to do."""

from __future__ import annotations

import pytest
import torch

from skyrl_mtp.rollout.worker_session_close import close_weight_update


class RecordingTransferEngine:
    """vLLM's WeightTransferEngine session surface: the target model, and every call in order."""

    supports_draft_weight_update = True

    def __init__(self, model):
        self.model = self._default_model = model
        self.calls = []

    def set_weight_update_target(self, model, model_config):
        self.model = model
        self.calls.append(("target", type(model).__name__))

    def reset_weight_update_target(self):
        self.model = self._default_model
        self.calls.append(("reset",))

    def start_weight_update(self):
        self.calls.append(("start",))

    def update_weights(self, update_info):
        self.calls.append(("update",))
        if update_info.get("fail"):
            raise RuntimeError("chunk refused by the worker")

    def finish_weight_update(self):
        self.calls.append(("finish", type(self.model).__name__))


def _stage_without_drafter():
    """A worker of a pipeline stage that is not the last: vLLM's session methods, no draft model, and the
    pipeline-parallel patch's draft target (a module that keeps nothing)."""
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_worker import Worker

    from skyrl_mtp.vllm_patches.pipeline_parallel import NoDrafterOnThisStage

    class StageWorker:
        start_draft_weight_update = Worker.start_draft_weight_update
        _start_weight_update = Worker._start_weight_update
        _check_weight_transfer_engine = Worker._check_weight_transfer_engine
        update_weights = Worker.update_weights
        finish_weight_update = Worker.finish_weight_update

        def __init__(self):
            self.vllm_config = VllmConfig()
            self.rank = 0
            self.weight_transfer_engine = RecordingTransferEngine(torch.nn.Linear(2, 2))
            self._weight_update_active = False
            self._weight_update_is_draft = False

        def get_model(self):
            return self.weight_transfer_engine._default_model

        def get_draft_model(self):
            return None

        def _set_draft_weight_update_target(self):   # as the pipeline-parallel patch sets it off the last stage
            self.weight_transfer_engine.set_weight_update_target(NoDrafterOnThisStage(), None)

    return StageWorker()


@pytest.mark.parametrize("how", ["session left open", "update raised in the worker"])
def test_an_aborted_draft_sync_closes_on_a_stage_without_the_drafter_and_the_next_sync_starts(how):
    w = _stage_without_drafter()
    w.start_draft_weight_update()
    if how == "update raised in the worker":   # vLLM clears its session flag itself (update_weights' except branch)
        with pytest.raises(RuntimeError, match="chunk refused"):
            w.update_weights({"fail": True})
    else:                                      # the update never reached the worker (an RPC or encoding error)
        w.update_weights({})
    done = close_weight_update(w, "draft")
    expected = "finished" if how == "session left open" else "nothing open"
    assert done == {"closed": expected, "layers_written": 0}
    assert w._weight_update_active is False
    if expected == "finished":   # vLLM's session finished on the module that keeps nothing, then retargeted
        assert w.weight_transfer_engine.calls[-2:] == [("finish", "NoDrafterOnThisStage"), ("reset",)]
    w.start_draft_weight_update()              # not refused as "already active"
    w.update_weights({})
    w.finish_weight_update()
    assert w._weight_update_active is False


def test_close_refuses_an_unknown_part():
    with pytest.raises(ValueError, match=r"part='head' is invalid; allowed: 'main', 'draft'"):
        close_weight_update(object(), "head")
