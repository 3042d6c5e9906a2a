"""The pipeline-parallel patch's drafter-embedding refresh (vllm_patches/pipeline_parallel.py) on the last stage, with
the target model inside vLLM's own CUDAGraphWrapper as a GPU runner with CUDA graphs holds it (built without its
CUDA graph pool, which this machine lacks), and vLLM's own Worker session methods and runner accessors. The
weight-transfer engine stand-in loads the way vLLM's nccl / ipc engines do: `self.model.load_weights(...)` on the
model it was built with (`model_runner.get_model()`, gpu_worker.load_model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from skyrl_mtp.vllm_patches import pipeline_parallel as pp

VOCAB, HIDDEN = 8, 4


class Target(torch.nn.Module):
    """The last stage's target model: no embedding of its own there (vLLM's PPMissingLayer), a norm."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Identity()
        self.model.norm = torch.nn.LayerNorm(HIDDEN)
        self.loaded: list[str] = []

    def load_weights(self, weights):
        for name, _ in weights:
            self.loaded.append(name)
        return set(self.loaded)


class Drafter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)


class LoadingTransferEngine:
    """vLLM's WeightTransferEngine session surface; update_weights loads like nccl_engine / ipc_engine."""

    supports_draft_weight_update = True

    def __init__(self, model):
        self.model = self._default_model = model

    def set_weight_update_target(self, model, model_config):
        self.model = model

    def reset_weight_update_target(self):
        self.model = self._default_model

    def start_weight_update(self):
        pass

    def update_weights(self, update_info):
        self.model.load_weights(list(update_info["weights"].items()))

    def finish_weight_update(self):
        pass


def _cuda_graph_wrapped(model):
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    wrapper = object.__new__(CUDAGraphWrapper)   # vLLM's class and its attribute forwarding, no graph pool
    wrapper.runnable = model
    wrapper.is_debugging_mode = False
    return wrapper


@pytest.fixture
def last_stage(monkeypatch):
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    monkeypatch.setattr(pp, "_pp", lambda: SimpleNamespace(is_last_rank=True))

    class Runner:
        get_model = GPUModelRunner.get_model
        get_draft_model = GPUModelRunner.get_draft_model

        def __init__(self):
            self.model = _cuda_graph_wrapped(Target())
            self.drafter = SimpleNamespace(model=Drafter())

        def reset_lora_state(self):
            pass

    class LastStageWorker:
        _start_weight_update = pp._start_weight_update(Worker._start_weight_update)
        finish_weight_update = pp._finish_weight_update(Worker.finish_weight_update)
        start_weight_update = Worker.start_weight_update
        update_weights = Worker.update_weights
        _check_weight_transfer_engine = Worker._check_weight_transfer_engine

        def __init__(self):
            self.vllm_config, self.rank = VllmConfig(), 0
            self.model_runner = Runner()
            self.weight_transfer_engine = LoadingTransferEngine(self.model_runner.get_model())
            self._weight_update_active = self._weight_update_is_draft = False

    return LastStageWorker()


def _sync(worker, weights):
    worker.start_weight_update()
    worker.update_weights({"weights": weights})
    worker.finish_weight_update()


def test_a_main_sync_refreshes_the_drafter_embedding_through_a_cuda_graph_wrapper(last_stage):
    runner = last_stage.model_runner
    assert type(runner.model).__name__ == "CUDAGraphWrapper" and runner.get_model() is not runner.model
    new = torch.arange(VOCAB * HIDDEN, dtype=torch.float32).view(VOCAB, HIDDEN)
    for step in range(2):
        _sync(last_stage, {"model.embed_tokens.weight": new + step, "model.norm.weight": torch.ones(HIDDEN)})
        assert torch.equal(runner.get_draft_model().model.embed_tokens.weight, new + step)
    assert runner.get_model().loaded == ["model.embed_tokens.weight", "model.norm.weight"] * 2   # all passed on
    assert runner._skyrl_pp_weight_stats["drafter_embedding_loads"] == 2


def test_a_main_sync_that_bypasses_the_refresh_fails_loudly(last_stage):
    runner = last_stage.model_runner
    target = runner.get_model()
    last_stage.start_weight_update()
    target.load_weights = Target.load_weights.__get__(target)   # the engine loads around the refresh
    last_stage.update_weights({"weights": {"model.embed_tokens.weight": torch.ones(VOCAB, HIDDEN)}})
    with pytest.raises(pp.DrafterEmbeddingNotRefreshed, match="none of its tensors passed through the refresh"):
        last_stage.finish_weight_update()
    assert last_stage._weight_update_active is False   # vLLM's session is closed all the same


def test_a_main_sync_without_the_trunk_embedding_fails_loudly_and_an_aborted_one_does_not(last_stage):
    with pytest.raises(pp.DrafterEmbeddingNotRefreshed, match="none of its 1 tensors is the trunk's embedding"):
        _sync(last_stage, {"model.norm.weight": torch.ones(HIDDEN)})
    last_stage.start_weight_update()
    pp.forget_weight_session(last_stage.model_runner)   # the worker's abort (rollout/worker_session_close.py)
    last_stage.finish_weight_update()


def test_a_transfer_engine_that_loads_elsewhere_is_refused_before_the_session_opens(last_stage):
    last_stage.weight_transfer_engine.model = Target()
    with pytest.raises(pp.PipelineParallelPatchError, match="loads the main model into a Target that is not the "
                                                            "runner's model"):
        last_stage.start_weight_update()
    assert last_stage._weight_update_active is False
