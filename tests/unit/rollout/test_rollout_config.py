"""EngineConfig / SamplingSpec / prompt validation: bad values fail early with the field, value and what is allowed."""

from __future__ import annotations

import json

import pytest

from skyrl_mtp.rollout.config import (
    MANAGED_ENGINE_KWARGS,
    EngineConfig,
    check_checkpoint,
    check_engine_kwargs_known,
)
from skyrl_mtp.rollout.engine import engine_environment
from skyrl_mtp.rollout.sampling import SamplingSpec, validate_prompts


def _ckpt(tmp_path, **cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"")
    return str(tmp_path)


@pytest.mark.parametrize("field,value,match", [
    ("num_speculative_tokens", -1, "num_speculative_tokens=-1"),
    ("num_speculative_tokens", 1.5, "num_speculative_tokens=1.5"),
    ("num_engines", 0, "num_engines=0"),
    ("dtype", "fp8", "dtype='fp8'"),
    ("max_num_seqs", 0, "max_num_seqs=0"),
    ("cpu_sampling_fix", "yes", "cpu_sampling_fix='yes'"),
    ("draft_invariant_sampling", 1, "draft_invariant_sampling=1"),
])
def test_engine_config_rejects_bad_fields(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model_path="/x", **{field: value})


def test_engine_kwargs_cannot_override_managed_keys():
    with pytest.raises(ValueError, match=r"engine_kwargs.*\['seed'\].*set by EngineConfig"):
        EngineConfig(model_path="/x", engine_kwargs={"seed": 3, "block_size": 16})
    cfg = EngineConfig(model_path="/x", engine_kwargs={"block_size": 16})
    merged = {**cfg.engine_kwargs, **cfg.managed_engine_kwargs("m.C")}
    assert merged["block_size"] == 16 and merged["worker_extension_cls"] == "m.C"
    assert set(cfg.managed_engine_kwargs("m.C")) == set(MANAGED_ENGINE_KWARGS)
    with pytest.raises(ValueError, match=r"\['no_such_arg'\] are not vLLM engine arguments"):
        check_engine_kwargs_known({"no_such_arg": 1}, {"block_size"})


def test_speculative_config_from_k():
    assert EngineConfig(model_path="/x").speculative_config is None
    assert EngineConfig(model_path="/x", num_speculative_tokens=3).speculative_config == {
        "method": "mtp", "num_speculative_tokens": 3}


def test_mtp_requested_on_checkpoint_without_mtp_layers(tmp_path):
    path = _ckpt(tmp_path, architectures=["MiMoForCausalLM"], num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=2.*num_nextn_predict_layers=0"):
        check_checkpoint(EngineConfig(model_path=path, num_speculative_tokens=2))
    assert check_checkpoint(EngineConfig(model_path=path))["num_nextn_predict_layers"] == 0
    with pytest.raises(ValueError, match="no config.json"):
        check_checkpoint(EngineConfig(model_path=str(tmp_path / "missing")))


def test_engine_environment_sets_the_sampling_fixes_and_nothing_else():
    assert engine_environment(EngineConfig(model_path="/x", cpu_sampling_fix=False)) == {
        "SKYRL_MTP_CPU_SAMPLING_FIX": "0", "SKYRL_MTP_DRAFT_INVARIANT_SAMPLING": "1"}
    assert engine_environment(EngineConfig(model_path="/x", draft_invariant_sampling=False)) == {
        "SKYRL_MTP_CPU_SAMPLING_FIX": "1", "SKYRL_MTP_DRAFT_INVARIANT_SAMPLING": "0"}
    # auto k's settings travel in vLLM's config, not in the environment (speculation/settings.py)
    assert engine_environment(EngineConfig(model_path="/x", num_speculative_tokens=2, adaptive_speculation=True,
                                           explore_budget=0.05, policy_trace_dir="/t")) == {
        "SKYRL_MTP_CPU_SAMPLING_FIX": "1", "SKYRL_MTP_DRAFT_INVARIANT_SAMPLING": "1"}


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.1}, "temperature=-0.1"),
    ({"max_tokens": 0}, "max_tokens=0"),
    ({"top_p": 0.0}, "top_p=0.0"),
    ({"top_k": -2}, "top_k=-2"),
    ({"n": 0}, "n=0"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop": [""]}, "stop"),
    ({"seed": 1.5}, "seed=1.5"),
])
def test_sampling_spec_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingSpec(**kwargs)


def test_sampling_spec_to_vllm_kwargs():
    kw = SamplingSpec(temperature=0.0, top_k=-1, max_tokens=5, seed=10, stop=["</a>"]).vllm_kwargs(prompt_index=3)
    assert kw["seed"] == 13 and kw["top_k"] == 0 and kw["logprobs"] == 1 and kw["max_tokens"] == 5
    assert kw["include_stop_str_in_output"] is True
    assert SamplingSpec().vllm_kwargs(5)["seed"] is None


@pytest.mark.parametrize("prompts,match", [
    ([], "non-empty list"),
    ([[1, 2], []], r"prompts\[1\]=\[\]"),
    ([[1, 600]], r"invalid token ids \[600\]"),
    ([[1] * 10], "max_model_len"),
])
def test_validate_prompts(prompts, match):
    with pytest.raises(ValueError, match=match):
        validate_prompts(prompts, vocab_size=512, max_model_len=8)
    validate_prompts([[1, 2, 3]], vocab_size=512, max_model_len=8)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU engine defaults")
def test_cpu_engine_runs_a_single_worker_in_process(monkeypatch):
    from skyrl_mtp.rollout.engine import cpu_engine_defaults, engine_process_environment

    one = cpu_engine_defaults(EngineConfig(model_path="/x"))
    assert one["distributed_executor_backend"] == "uni" and one["enable_chunked_prefill"] is False
    assert "distributed_executor_backend" not in cpu_engine_defaults(EngineConfig(model_path="/x",
                                                                                  tensor_parallel_size=2))
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    # a "uni" engine binds nothing (vLLM reads the binding only where its mp executor starts workers)
    assert engine_process_environment(one, on_cpu=True, engine_index=1, cpus=[0, 1]) == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert engine_process_environment({"distributed_executor_backend": "mp"}, on_cpu=False, cpus=[0, 1]) == {}
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")   # the user's setting wins
    assert engine_process_environment(one, on_cpu=True) == {}


def test_mp_cpu_engines_bind_each_worker_to_a_core_of_its_own(monkeypatch):
    from skyrl_mtp.rollout.engine import engine_process_environment, unread_thread_binding

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)

    def bind(kwargs, index, cpus):
        return engine_process_environment(kwargs, on_cpu=True, engine_index=index, cpus=cpus)["VLLM_CPU_OMP_THREADS_BIND"]

    mp = {"distributed_executor_backend": "mp"}
    # from the last allowed core down (a cpuset need not start at 0), wrapping when engines outnumber cores
    assert [bind(mp, i, [9, 4, 5, 6]) for i in range(5)] == ["9", "6", "5", "4", "9"]
    # one core per worker, ranks separated by "|" as vLLM parses it
    two = {**mp, "tensor_parallel_size": 2}
    assert [bind(two, i, range(8)) for i in range(3)] == ["7|6", "5|4", "3|2"]
    assert bind({**two, "pipeline_parallel_size": 2}, 1, range(8)) == "3|2|1|0"
    # the user's binding is theirs; warned about only where vLLM would not read it
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine_process_environment(mp, on_cpu=True, cpus=[0, 1])
    assert unread_thread_binding(mp, on_cpu=True) is None
    assert unread_thread_binding({"distributed_executor_backend": "uni"}, on_cpu=False) is None
    warning = unread_thread_binding({"distributed_executor_backend": "uni"}, on_cpu=True)
    assert "VLLM_CPU_OMP_THREADS_BIND='0-1' is ignored" in warning and "distributed_executor_backend=mp" in warning
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    assert unread_thread_binding({"distributed_executor_backend": "uni"}, on_cpu=True) is None
