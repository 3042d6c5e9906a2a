"""Pure parts of weight sync: schema from safetensors headers, update validation, wire format, NCCL layout."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from skyrl_mtp.rollout.client import assign_least_loaded
from skyrl_mtp.rollout.engine import completion_to_output
from skyrl_mtp.rollout.weight_sync import (
    TensorSpec,
    WeightSyncError,
    broadcast_plan,
    describe_tensors,
    deserialize_weights,
    drafter_subset,
    nccl_group_layout,
    read_weight_schema,
    serialize_weights,
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


def test_blob_round_trip_and_aliasing(weights):
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]   # tied: same storage
    back = deserialize_weights(serialize_weights(weights))
    assert set(back) == set(weights)
    for n, t in weights.items():
        assert torch.equal(back[n], t)
    assert drafter_subset(list(weights)) == ["model.embed_tokens.weight", "model.mtp_layers.0.input_proj.weight",
                                             "lm_head.weight"]


def test_nccl_layout_and_plan(weights):
    layout = nccl_group_layout([1, 2, 1])
    assert layout.world_size == 5 and layout.engine_rank_offsets == (1, 2, 4)
    with pytest.raises(ValueError, match="engine_tp_sizes"):
        nccl_group_layout([])
    plan = broadcast_plan(weights)
    assert plan[0] == ("model.embed_tokens.weight", [16, 8], "float32")
    assert [p[0] for p in plan] == list(weights)


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
    from skyrl_mtp.rollout.weight_sync import TensorSpec, WeightSyncError, validate_update

    schema = {"model.norm.weight": TensorSpec((4,), "float32"), "model.mtp_layers.0.x": TensorSpec((4,), "float32")}
    main_only = {"model.norm.weight": ((4,), "float32")}
    validate_update(main_only, schema, "float32", optional=["model.mtp_layers.0.x"])
    with pytest.raises(WeightSyncError, match="missing weight names \\['model.mtp_layers.0.x'\\]"):
        validate_update(main_only, schema, "float32")
    with pytest.raises(WeightSyncError, match="missing weight names \\['model.norm.weight'\\]"):
        validate_update({"model.mtp_layers.0.x": ((4,), "float32")}, schema, "float32",
                        optional=["model.mtp_layers.0.x"])
