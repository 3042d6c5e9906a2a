"""EngineConfig / SamplingSpec / prompt validation: bad values fail early with the field, value and what is allowed."""

from __future__ import annotations

import json

import pytest
import torch

from skyrl_mtp.rollout.config import (
    MANAGED_ENGINE_KWARGS,
    EngineConfig,
    check_checkpoint,
    check_engine_kwargs_known,
)
from skyrl_mtp.rollout.engine import engine_environment, engine_process_settings
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


def test_engine_process_settings_carry_the_sampling_switches(monkeypatch):
    from skyrl_mtp import engine_process

    off = engine_process_settings(EngineConfig(model_path="/x", cpu_sampling_fix=False))
    assert (off.cpu_sampling_fix, off.draft_invariant_sampling) == (False, True)
    no_coupling = engine_process_settings(EngineConfig(model_path="/x", draft_invariant_sampling=False), "qwen3_5")
    assert (no_coupling.draft_invariant_sampling, no_coupling.model_family) == (False, "qwen3_5")
    drafting = engine_process_settings(EngineConfig(model_path="/x", num_speculative_tokens=2))
    # vLLM's own variables: the V1 runner unless the config chooses V2
    assert engine_environment(EngineConfig(model_path="/x")) == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    # auto k's settings travel in vLLM's config, not in the environment (speculation/settings.py)
    assert engine_environment(EngineConfig(model_path="/x", num_speculative_tokens=2, adaptive_speculation=True,
                                           explore_budget=0.05, policy_trace_dir="/t")) == {
        "VLLM_USE_V2_MODEL_RUNNER": "0"}
    # one variable carries the whole object, and a process reads back exactly what was set
    (name, value), = drafting.to_env().items()
    monkeypatch.setenv(name, value)
    assert engine_process.current() == drafting
    monkeypatch.setenv(name, value.replace('"model_family"', '"an_unknown_field"'))
    with pytest.raises(ValueError, match="unknown fields"):
        engine_process.current()


def test_ipc_engines_allow_vllms_pickle_fallback_and_others_do_not():
    ipc = engine_environment(EngineConfig(model_path="/x", weight_transfer_backend="ipc"))
    assert ipc["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    for backend in ("nccl", "skyrl_cpu"):
        assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in engine_environment(
            EngineConfig(model_path="/x", weight_transfer_backend=backend))


def _ipc_handle_args():
    """The shape of torch's reduce_tensor args for a CUDA tensor (multiprocessing/reductions.py rebuild_cuda_tensor):
    classes, a dtype and bytes, as vLLM's IPC transport puts them in every update."""
    return (torch.Tensor, (4, 2), (2, 1), 0, torch.UntypedStorage, torch.bfloat16, 0, b"\x01" * 64, 16, 0, False,
            b"\x02" * 16, 0, b"\x03" * 64, True)


def test_vllms_rpc_encoder_refuses_ipc_handles_without_the_flag(monkeypatch):
    # what AsyncLLM.update_weights sends the engine core (a collective_rpc through v1/serial_utils.py's msgpack)
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    payload = {"update_info": {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[4, 2]],
                               "ipc_handles": {"GPU-uuid": _ipc_handle_args()}, "tensor_sizes": [16]}}
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    with pytest.raises(TypeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
        MsgpackEncoder().encode(payload)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")   # what engine_environment sets for ipc
    back = MsgpackDecoder().decode(MsgpackEncoder().encode(payload))
    args = back["update_info"]["ipc_handles"]["GPU-uuid"]
    assert args[0] is torch.Tensor and args[4] is torch.UntypedStorage and args[5] is torch.bfloat16
    assert args[7] == b"\x01" * 64


def test_the_model_runner_is_pinned_to_v1_and_v2_runs_without_the_v1_only_features():
    from skyrl_mtp.rollout.config import V1_ONLY_FEATURES
    from skyrl_mtp.rollout.engine import v2_warning

    v1 = EngineConfig(model_path="/x", num_speculative_tokens=2)
    assert engine_environment(v1)["VLLM_USE_V2_MODEL_RUNNER"] == "0" and v1.v1_features_off() == {}
    v2 = EngineConfig(model_path="/x", num_speculative_tokens=2, model_runner="v2")
    assert engine_environment(v2)["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    on_v2 = engine_process_settings(v2)   # what the engine's workers patch: nothing V1-only
    assert on_v2.draft_invariant_sampling is False and on_v2.cpu_sampling_fix is False
    lost = v2.v1_features_off()
    assert list(lost) == ["draft_invariant_sampling", "cpu_sampling_fix", "compile_warmup"]
    text = v2_warning(lost)
    assert all(f"{name} (lost: {V1_ONLY_FEATURES[name]})" in text for name in lost)
    with pytest.raises(ValueError, match="model_runner='v2' is invalid: 'v1' with adaptive_speculation=True"):
        EngineConfig(model_path="/x", num_speculative_tokens=2, adaptive_speculation=True, model_runner="v2")
    with pytest.raises(ValueError, match=r"model_runner='v3' is invalid: one of \('v1', 'v2'\)"):
        EngineConfig(model_path="/x", model_runner="v3")


def test_an_unkept_draft_invariance_is_warned_loudly():
    from skyrl_mtp.rollout.config import unkept_guarantees

    cfg = EngineConfig(model_path="/x", num_speculative_tokens=2)
    assert unkept_guarantees(cfg, ["installed", "installed"]) == []
    (gpu,) = unkept_guarantees(cfg, ["installed", "not_cpu"])
    assert gpu.startswith("generator.draft_invariant_sampling=true is NOT honoured: not_cpu: it is implemented for "
                          "vLLM's CPU sampler only")
    assert "no longer equal plain ones token for token" in gpu
    # nothing promised, nothing to warn about: the setting off, or no speculative decoding
    assert unkept_guarantees(EngineConfig(model_path="/x", num_speculative_tokens=2, draft_invariant_sampling=False),
                             ["disabled"]) == []
    assert unkept_guarantees(EngineConfig(model_path="/x"), ["not_cpu"]) == []


def test_engine_client_warns_when_the_engines_cannot_keep_draft_invariance(monkeypatch):
    import ray

    from skyrl_mtp.rollout import client as client_mod
    from skyrl_mtp.rollout.config import GuaranteeWarning

    infos = [{"schema": {}, "vocab_size": 8, "model_runner": "v1", "draft_invariant_sampling": "not_cpu"}]

    class Actor:
        class ready:
            @staticmethod
            def remote():
                return infos[0]

    class Remote:
        def __init__(self, cls):
            pass

        def options(self, **_):
            return self

        def remote(self, *_):
            return Actor()

    monkeypatch.setattr(client_mod, "check_checkpoint", lambda cfg: {})
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "remote", Remote)
    monkeypatch.setattr(ray, "get", lambda refs, **_: refs)
    monkeypatch.setattr(ray, "kill", lambda actor: None)
    with pytest.warns(GuaranteeWarning, match="generator.draft_invariant_sampling=true is NOT honoured: not_cpu"):
        client_mod.EngineClient.create(EngineConfig(model_path="/x", num_speculative_tokens=1))
    infos[0] = {**infos[0], "model_runner": "v2"}
    with pytest.raises(RuntimeError, match=r"engines \[0\] run vLLM's model runner \['v2'\], not "
                                           r"EngineConfig.model_runner='v1'"):
        client_mod.EngineClient.create(EngineConfig(model_path="/x", num_speculative_tokens=1))


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
    assert SamplingSpec().vllm_kwargs()["ignore_eos"] is False and SamplingSpec(ignore_eos=True).vllm_kwargs()["ignore_eos"]
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingSpec(ignore_eos=1)


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
    # several workers: vLLM's multiprocessing executor (in a Ray actor vLLM would pick its Ray one, which its CPU
    # platform refuses)
    for layout in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        assert cpu_engine_defaults(EngineConfig(model_path="/x", **layout))["distributed_executor_backend"] == "mp"
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
