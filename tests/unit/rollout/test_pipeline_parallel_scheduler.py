"""The pipeline-parallel draft scheduler (rollout/pipeline_parallel_scheduler.py) on vLLM's real Scheduler objects,
driven the way vLLM's engine core drives them with a batch queue of 2 (PP=2, `EngineCore.step_with_batch_queue` and
`post_step`): schedule a batch, schedule the next, apply the first one's output, take the drafts of the batch the
last stage just sampled. With chunked prefill one request sits in two in-flight batches at once."""

from __future__ import annotations

import json

import pytest

K = 2
BUDGET = 48          # max_num_batched_tokens: an 83-token prompt is prefilled in two chunks (48 + 35)
PROMPT_LEN = 83


@pytest.fixture(scope="module")
def scheduler_factory(tmp_path_factory):
    """vLLM's VllmConfig for a tiny MiMo (config.json only: the scheduler never loads weights), PP=2, MTP k=2,
    chunked prefill on; returns a function that builds a fresh PipelineParallelDraftScheduler."""
    import torch
    from vllm.config import (
        CacheConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from skyrl_mtp.rollout.pipeline_parallel_scheduler import PipelineParallelDraftScheduler

    path = tmp_path_factory.mktemp("mimo_config")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["MiMoForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 512,
        "max_position_embeddings": 512, "num_nextn_predict_layers": 1, "torch_dtype": "float32",
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}))
    model = ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256)
    parallel = ParallelConfig(pipeline_parallel_size=2, distributed_executor_backend="mp")
    vllm_config = VllmConfig(
        model_config=model, parallel_config=parallel, cache_config=CacheConfig(block_size=16, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=BUDGET, max_model_len=256,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        speculative_config=SpeculativeConfig(method="mtp", num_speculative_tokens=K, target_model_config=model,
                                             target_parallel_config=parallel))
    assert vllm_config.scheduler_config.enable_chunked_prefill and not vllm_config.scheduler_config.async_scheduling

    vllm_config.cache_config.num_gpu_blocks = 64   # what the engine core sets after profiling the KV cache

    def build():
        spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.float32)
        kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        return PipelineParallelDraftScheduler(vllm_config=vllm_config, kv_cache_config=kv, block_size=16,
                                              structured_output_manager=StructuredOutputManager(vllm_config))
    return build


def _request(req_id: str, n: int):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, list(range(10, 10 + n)), SamplingParams(temperature=0.0, max_tokens=16), None)


def _output(so, sampled: dict[str, list[int]]):
    """What the last stage returns for batch `so`: `sampled[req]` kept tokens ([] for a prefill chunk)."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[sampled.get(r, []) for r in ids])


def _drafts(req_id: str, tokens: list[int]):
    from vllm.v1.outputs import DraftTokenIds

    return DraftTokenIds([req_id], [list(tokens)])


def test_drafts_wait_for_the_last_in_flight_batch_of_a_chunked_prefill(scheduler_factory):
    sched = scheduler_factory()
    req = _request("r", PROMPT_LEN)
    sched.add_request(req)
    a = sched.schedule()                       # chunk 1 [0, 48)
    sched.update_draft_token_ids(_drafts("r", [1, 2]))   # post_step after batch a: the drafter's guess on a chunk
    b = sched.schedule()                       # chunk 2 [48, 83) while chunk 1 is still in the pipeline
    assert a.num_scheduled_tokens == {"r": BUDGET} and b.num_scheduled_tokens == {"r": PROMPT_LEN - BUDGET}
    sched.update_from_output(a, _output(a, {"r": []}))   # chunk 1 done: its sample is discarded
    sched.update_draft_token_ids(_drafts("r", [7, 8]))   # post_step after batch b: the drafts that follow b's token
    # b's token has not been applied: its drafts must wait, and nothing of r may be scheduled meanwhile (vLLM would
    # send the 2 drafts alone, without the token they follow)
    assert req.spec_token_ids == [] and req.num_output_tokens == 0
    assert sched.schedule().num_scheduled_tokens == {}
    sched.update_from_output(b, _output(b, {"r": [100]}))
    assert list(req.output_token_ids) == [100] and req.spec_token_ids == [7, 8]
    c = sched.schedule()                       # the verify step: the sampled token, then its drafts
    assert c.num_scheduled_tokens == {"r": 1 + K} and c.scheduled_spec_decode_tokens == {"r": [7, 8]}
    assert c.scheduled_cached_reqs.num_computed_tokens == [PROMPT_LEN]


def test_drafts_of_a_request_in_one_batch_still_follow_its_output(scheduler_factory):
    sched = scheduler_factory()
    req = _request("s", 20)                    # fits one chunk: one batch in flight, as without chunking
    sched.add_request(req)
    a = sched.schedule()
    sched.update_draft_token_ids(_drafts("s", [5, 6]))
    assert req.spec_token_ids == [] and sched.held_draft_sets == 1
    sched.update_from_output(a, _output(a, {"s": [42]}))
    assert list(req.output_token_ids) == [42] and req.spec_token_ids == [5, 6]
