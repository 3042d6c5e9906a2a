"""Pure parts of weight sync: schema from safetensors headers, update validation, the parts of a sync
(main model / MTP drafter), the transport seam, per-engine rank offsets of the transfer group."""

from __future__ import annotations

import socket

import pytest
import torch
from safetensors.torch import save_file

from skyrl_mtp.rollout.client import assign_least_loaded
from skyrl_mtp.rollout.outputs import completion_to_output
from skyrl_mtp.weight_sync.schema import (
    TensorSpec,
    WeightSyncError,
    check_update_info,
    describe_tensors,
    part_names,
    part_schema,
    read_weight_schema,
    validate_update,
)


@pytest.fixture
def weights():
    g = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(16, 8, generator=g),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
            "model.mtp_layers.0.input_proj.weight": torch.randn(8, 16, generator=g)}


def test_schema_read_from_checkpoint_headers(tmp_path, weights):
    save_file(weights, str(tmp_path / "model.safetensors"))
    schema = read_weight_schema(tmp_path)
    assert schema == {n: TensorSpec(tuple(t.shape), "float32") for n, t in weights.items()}
    with pytest.raises(WeightSyncError, match="no \\*.safetensors"):
        read_weight_schema(tmp_path / "nothing")


def test_validate_update_accepts_exact_match_and_engine_dtype(weights):
    schema = {n: TensorSpec(tuple(t.shape), "float32") for n, t in weights.items()}
    validate_update(describe_tensors(weights), schema, "float32")
    bf16 = {n: t.to(torch.bfloat16) for n, t in weights.items()}
    validate_update(describe_tensors(bf16), schema, "bfloat16")
    with pytest.raises(WeightSyncError, match=r"dtype bfloat16; allowed: \['float32'\]"):
        validate_update(describe_tensors(bf16), schema, "float32")


@pytest.mark.parametrize("mutate,match", [
    (lambda w: w.update({"model.layers.9.bogus": torch.zeros(1)}), r"unknown weight names \['model.layers.9.bogus'\]"),
    (lambda w: w.pop("model.mtp_layers.0.input_proj.weight"), r"missing weight names.*input_proj"),
    (lambda w: w.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 9)}),
     r"q_proj.weight' has shape \(8, 9\); allowed: \(8, 8\)"),
    (lambda w: w.update({"model.embed_tokens.weight": torch.zeros(16, 8, dtype=torch.int64)}),
     r"embed_tokens.weight' has dtype int64"),
])
def test_validate_update_rejects_bad_updates(weights, mutate, match):
    schema = {n: TensorSpec(tuple(t.shape), "float32") for n, t in weights.items()}
    bad = dict(weights)
    mutate(bad)
    with pytest.raises(WeightSyncError, match=match):
        validate_update(describe_tensors(bad), schema, "float32")


def test_sync_parts_partition_the_checkpoint(weights):
    weights["lm_head.weight"] = torch.zeros(16, 8)
    names = list(weights)
    assert part_names(names, "main") == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                                         "lm_head.weight"]
    assert part_names(names, "draft") == ["model.mtp_layers.0.input_proj.weight"]
    assert sorted(part_names(names, "main") + part_names(names, "draft")) == sorted(names)
    with pytest.raises(ValueError, match="part 'both' is invalid"):
        part_names(names, "both")


def test_update_info_chunks_are_checked_against_their_part(weights):
    schema = {n: TensorSpec(tuple(t.shape), "float32") for n, t in weights.items()}
    q = "model.layers.0.self_attn.q_proj.weight"
    check_update_info({"names": [q], "dtype_names": ["float32"], "shapes": [[8, 8]]}, schema, "main", "float32")
    with pytest.raises(WeightSyncError, match=rf"weight '{q}' has shape \(8, 9\)"):
        check_update_info({"names": [q], "dtype_names": ["float32"], "shapes": [[8, 9]]}, schema, "main", "float32")
    with pytest.raises(WeightSyncError, match=r"unknown weight names \['model.mtp_layers.0.input_proj.weight'\]"):
        check_update_info({"names": ["model.mtp_layers.0.input_proj.weight"], "dtype_names": ["float32"],
                           "shapes": [[8, 16]]}, schema, "main", "float32")   # the drafter's tensor in a main session
    with pytest.raises(WeightSyncError, match="lacks names/dtype_names/shapes"):
        check_update_info({"names": [q]}, schema, "main", "float32")
    assert set(part_schema(schema, "draft")) == {"model.mtp_layers.0.input_proj.weight"}


def test_transport_seam():
    from skyrl_mtp.weight_sync.transport import choose_backend, trainer_init_info

    assert choose_backend(on_gpu=False, gpus_shared_with_policy=False) == "skyrl_cpu"
    assert choose_backend(on_gpu=False, gpus_shared_with_policy=True) == "skyrl_cpu"
    assert choose_backend(on_gpu=True, gpus_shared_with_policy=False) == "nccl"
    assert choose_backend(on_gpu=True, gpus_shared_with_policy=True) == "ipc"
    cpu = trainer_init_info("skyrl_cpu", rank=0, master_address="127.0.0.1", master_port=1234, world_size=3)
    assert (cpu.backend, cpu.is_sender, cpu.world_size) == ("skyrl_cpu", True, 3)
    nccl = trainer_init_info("nccl", rank=1, master_address="127.0.0.1", master_port=1234, world_size=3)
    assert (nccl.backend, nccl.is_sender, nccl.packed) == ("nccl", False, True)
    with pytest.raises(ValueError, match="backend 'gloo' is invalid"):
        trainer_init_info("gloo", rank=0)
    with socket.socket() as sock, pytest.raises(ValueError, match="only used by the 'skyrl_cpu' transport, not 'nccl'"):
        trainer_init_info("nccl", rank=0, master_address="127.0.0.1", master_port=1234, world_size=3,
                          listen_socket=sock)


def test_cpu_transport_registered_in_both_vllm_factories():
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from skyrl_mtp.weight_sync import register_cpu_transport
    from skyrl_mtp.weight_sync.cpu_transport import (
        CPUTrainerWeightTransferEngine,
        CPUWeightTransferEngine,
    )

    register_cpu_transport()
    register_cpu_transport()   # idempotent
    assert WeightTransferEngineFactory._registry["skyrl_cpu"]() is CPUWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["skyrl_cpu"]() is CPUTrainerWeightTransferEngine


def test_engine_actors_client_shifts_rank_offsets_per_engine(monkeypatch):
    from skyrl_mtp.weight_sync.engine_actors_client import EngineActorsClient

    calls = []

    class Method:
        def __init__(self, actor, name):
            self.actor, self.name = actor, name

        def remote(self, *args):
            calls.append((self.actor.i, self.name, args))
            return None

    class Actor:
        def __init__(self, i):
            self.i = i

        def __getattr__(self, name):
            return Method(self, name)

    import ray

    monkeypatch.setattr(ray, "get", lambda refs: refs)
    client = EngineActorsClient([Actor(0), Actor(1), Actor(2)], workers_per_engine=2)
    client.init_weight_transfer_engine({"rank_offset": 1, "world_size": 7})
    assert [c[2][0]["rank_offset"] for c in calls] == [1, 3, 5]
    calls.clear()
    client.start_weight_update()
    client.part = "draft"
    client.start_weight_update()
    assert [c[2] for c in calls] == [(False,)] * 3 + [(True,)] * 3


def test_least_loaded_assignment():
    assert assign_least_loaded(4, [0, 0]) == [0, 1, 0, 1]
    assert assign_least_loaded(3, [5, 0, 1]) == [1, 1, 2]
    assert assign_least_loaded(2, [0, 3], weight=4) == [0, 1]
    with pytest.raises(ValueError):
        assign_least_loaded(1, [])


def test_completion_to_output_picks_sampled_token_logprob():
    class LP:
        def __init__(self, v):
            self.logprob = v

    class C:
        token_ids = [5, 7]
        logprobs = [{5: LP(-0.5), 1: LP(-0.1)}, {7: LP(-2.0)}]
        finish_reason = "length"
        text = "ab"

    out = completion_to_output(C())
    assert out.token_ids == [5, 7] and out.logprobs == [-0.5, -2.0] and out.finish_reason == "length"
    C.logprobs = None
    with pytest.raises(RuntimeError, match="logprob"):
        completion_to_output(C())


def test_optional_names_may_be_missing_but_nothing_else():
    from skyrl_mtp.weight_sync.schema import TensorSpec, WeightSyncError, validate_update

    schema = {"model.norm.weight": TensorSpec((4,), "float32"), "model.mtp_layers.0.x": TensorSpec((4,), "float32")}
    main_only = {"model.norm.weight": ((4,), "float32")}
    validate_update(main_only, schema, "float32", optional=["model.mtp_layers.0.x"])
    with pytest.raises(WeightSyncError, match="missing weight names \\['model.mtp_layers.0.x'\\]"):
        validate_update(main_only, schema, "float32")
    with pytest.raises(WeightSyncError, match="missing weight names \\['model.norm.weight'\\]"):
        validate_update({"model.mtp_layers.0.x": ((4,), "float32")}, schema, "float32",
                        optional=["model.mtp_layers.0.x"])
