"""The device seam's decision, the lazy TP-shard reader (equal to slicing the whole state dict) and the
streaming safetensors writer (header first, then tensor by tensor)."""

from __future__ import annotations

import pytest
import torch
from mimo_fixture import mimo_config, random_mimo_weights, write_mimo_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from skyrl_mtp.models.families.base import WeightMappingError
from skyrl_mtp.policy.megatron.device import CPU_MEGATRON_OPTIMIZER_ENV, choose_device, rank_device
from skyrl_mtp.policy.megatron.hf_bridge import hf_to_megatron
from skyrl_mtp.policy.megatron.hf_export import StreamExportError, write_safetensors_stream
from skyrl_mtp.policy.megatron.model_builder import model_args_from_checkpoint
from skyrl_mtp.policy.megatron.sharded_loading import LazyHFCheckpoint, check_checkpoint, iter_tp_shard


@pytest.mark.parametrize("kw,expect", [
    # a Ray actor with a GPU: its own view's cuda:0, NCCL
    (dict(cuda_available=True, cuda_device_count=1, ray_gpu_ids=[3], local_rank=5), ("cuda:0", "nccl")),
    # a Ray actor without a GPU on a GPU machine (Ray hides them): CPU, gloo
    (dict(cuda_available=False, cuda_device_count=0, ray_gpu_ids=[], local_rank=0), ("cpu", "gloo")),
    (dict(cuda_available=True, cuda_device_count=8, ray_gpu_ids=[], local_rank=0), ("cpu", "gloo")),
    # outside Ray: LOCAL_RANK picks the GPU
    (dict(cuda_available=True, cuda_device_count=4, ray_gpu_ids=None, local_rank=6), ("cuda:2", "nccl")),
    (dict(cuda_available=False, cuda_device_count=0, ray_gpu_ids=None, local_rank=0), ("cpu", "gloo")),
])
def test_choose_device(kw, expect):
    d = choose_device(**kw)
    assert (str(d.device), d.backend) == expect
    assert d.megatron_optimizer == (expect[1] == "nccl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the opt-in concerns CPU ranks")
def test_cpu_rank_opts_into_the_megatron_optimizer_by_env(monkeypatch):
    monkeypatch.delenv(CPU_MEGATRON_OPTIMIZER_ENV, raising=False)
    assert not rank_device().megatron_optimizer
    monkeypatch.setenv(CPU_MEGATRON_OPTIMIZER_ENV, "1")
    d = rank_device()
    assert (str(d.device), d.backend, d.megatron_optimizer) == ("cpu", "gloo", True)
    monkeypatch.setenv(CPU_MEGATRON_OPTIMIZER_ENV, "yes")
    with pytest.raises(ValueError, match=f"{CPU_MEGATRON_OPTIMIZER_ENV}='yes' is invalid; allowed: '0', '1'"):
        rank_device()


def test_choose_device_refuses_a_gpu_torch_cannot_see():
    with pytest.raises(RuntimeError, match=r"Ray assigned GPU\(s\) \[0\] .* torch sees no CUDA"):
        choose_device(cuda_available=False, cuda_device_count=0, ray_gpu_ids=[0], local_rank=0)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_lazy_shard_equals_slicing_the_whole_state_dict(tmp_path, tp, tie):
    ckpt = write_mimo_checkpoint(tmp_path / "ck", mimo_config(tie=tie, kv_heads=4))
    args = model_args_from_checkpoint(ckpt)
    whole = load_file(str(ckpt / "model.safetensors"))
    lazy = LazyHFCheckpoint(ckpt)
    rules = check_checkpoint(lazy, args, 1)
    for rank in range(tp):
        ref = hf_to_megatron(whole, args, 1, tp_rank=rank, tp_size=tp)
        got = dict(iter_tp_shard(lazy, rules, tp_rank=rank, tp_size=tp))
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), (rank, k)


def test_lazy_chunk_reads_only_the_rank_slice(tmp_path):
    save_file({"w": torch.arange(24.0).reshape(4, 6)}, str(tmp_path / "model.safetensors"))
    lazy = LazyHFCheckpoint(tmp_path)
    assert lazy.shape("w") == (4, 6)
    assert torch.equal(lazy.chunk("w", 1, 1, 2), torch.arange(24.0).reshape(4, 6)[:, 3:])
    assert torch.equal(lazy.chunk("w", 0, 3, 4), torch.arange(18.0, 24.0).reshape(1, 6))
    with pytest.raises(WeightMappingError, match="not divisible by tp=4"):
        lazy.chunk("w", 1, 0, 4)


def test_checkpoint_mismatch_named_from_headers(tmp_path):
    cfg = mimo_config()
    sd = random_mimo_weights(cfg)
    sd["model.bogus.weight"] = torch.zeros(2)
    del sd["model.norm.weight"]
    ck = tmp_path / "ck"
    write_mimo_checkpoint(ck, cfg)
    save_file(sd, str(ck / "model.safetensors"))
    lazy = LazyHFCheckpoint(ck)
    with pytest.raises(WeightMappingError, match=r"missing \['model.norm.weight'\]; unexpected \['model.bogus.weight'\]"):
        check_checkpoint(lazy, model_args_from_checkpoint(ck), 1)


def test_stream_writer_round_trip(tmp_path):
    ts = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "c": torch.arange(6).reshape(2, 3)}
    layout = [(k, tuple(v.shape), v.dtype) for k, v in ts.items()]
    out = write_safetensors_stream(tmp_path / "model.safetensors", layout, iter(ts.items()))
    back = load_file(str(out))
    assert back.keys() == ts.keys() and all(torch.equal(back[k], v) for k, v in ts.items())
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_stream_writer_refuses_a_stream_unlike_its_layout(tmp_path):
    layout = [("a", (2,), torch.float32), ("b", (2,), torch.float32)]
    with pytest.raises(StreamExportError, match=r"gave 'b' \(2,\) torch.float32; expected 'a'"):
        write_safetensors_stream(tmp_path / "x.safetensors", layout, iter([("b", torch.zeros(2))]))
    with pytest.raises(StreamExportError, match="ended before 'b'"):
        write_safetensors_stream(tmp_path / "x.safetensors", layout, iter([("a", torch.zeros(2))]))
    with pytest.raises(StreamExportError, match="more tensors than announced"):
        write_safetensors_stream(tmp_path / "x.safetensors", layout[:1], iter([("a", torch.zeros(2)), ("b", torch.zeros(2))]))
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind


class _Side:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def offload_to_host(self):
        self.calls.append(f"offload {self.name}")

    def restore_to_device(self):
        self.calls.append(f"restore {self.name}")


def test_handing_memory_to_colocated_engines_is_a_no_op_on_cpu_and_ordered_on_gpu(monkeypatch):
    import torch

    from skyrl_mtp.policy.megatron.device import RankDevice, hand_over_to_engines, take_back_from_engines

    calls: list[str] = []
    sides = [_Side("policy", calls), _Side("head", calls)]
    cpu = RankDevice(torch.device("cpu"), "gloo")
    assert hand_over_to_engines(cpu, sides, offload=True) == [] and take_back_from_engines(cpu, sides, offload=True) == []
    assert calls == []                                  # CPU: nothing to hand over, nothing called
    gpu = RankDevice(torch.device("cuda", 0), "nccl")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    assert hand_over_to_engines(gpu, sides, offload=True) == ["offload policy", "offload head", "empty_cache"]
    assert calls == ["offload policy", "offload head", "empty_cache"]   # the cache emptied after the offload
    assert take_back_from_engines(gpu, sides, offload=True) == ["restore policy", "restore head"]
    calls.clear()
    assert hand_over_to_engines(gpu, sides, offload=False) == ["empty_cache"]   # the plan did not ask for offload
    assert take_back_from_engines(gpu, sides, offload=False) == [] and calls == ["empty_cache"]
