"""The kernels the policy uses on GPUs, against the paths they replace, on the CPU in fp32.

megatron.layer_impl=sdpa: torch's scaled_dot_product_attention as the policy's core attention computes what
megatron-core's local DotProductAttention computes (fp32, outputs and gradients to 1e-5; a whole model's parameter
gradients to 1e-5 of their largest), with and without grouped
k/v heads, on causal rows and on packed rows (the dense mask policy/batch_layout.py builds), as a module and inside
whole tiny models of every family it is wired into. The fused SwiGLU (megatron-core's bias_activation_fusion, on for
GPU ranks) computes what the unfused MLP does. One spawned process runs megatron-core (its parallel state and CPU
shim stay out of this one)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from kernel_equivalence_rank import run

from skyrl_mtp.models.families.base import ModelBuildError

TOL = 1e-5


@pytest.fixture(scope="module")
def diffs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sdpa") / "res.pt"
    mp.start_processes(run, args=(str(out),), nprocs=1, join=True, start_method="spawn")
    return torch.load(out)


@pytest.mark.parametrize("case", ["causal/gqa", "causal/mha", "packed/gqa", "packed/mha"])
def test_the_core_attention_equals_the_local_one(diffs, case):
    assert diffs[f"{case}/scale"] > 0.1                       # not a comparison of zeros
    assert diffs[f"{case}/out"] < TOL and diffs[f"{case}/grad"] < TOL, (diffs[f"{case}/out"], diffs[f"{case}/grad"])


def test_the_local_attentions_score_buffer_is_released_for_the_engines(diffs):
    assert diffs["buffer/held_bytes"] == 2 * 4 * 12 * 12 * 4   # [rows x heads, S, S] fp32, the largest asked for
    assert diffs["buffer/released"] == 1 and diffs["buffer/after"] == 0


@pytest.mark.parametrize("family", ["mimo", "qwen3_5", "deepseek_v3", "glm4_moe"])
def test_every_family_builds_it_and_its_logits_and_grads_equal_the_local_specs(diffs, family):
    # every attention layer's core attention, the MTP layer's too (Qwen3.5's Gated DeltaNet layers have none)
    assert diffs[f"{family}/sdpa_modules"] == diffs[f"{family}/attention_layers"] >= 2
    assert diffs[f"{family}/mtp_sdpa"] == 1 and diffs[f"{family}/local_has_sdpa"] == 0
    for name in ("causal", "packed"):
        if f"{family}/{name}/logits" not in diffs:    # a family without packed rows (Gated DeltaNet)
            assert family == "qwen3_5" and name == "packed"
            continue
        assert diffs[f"{family}/{name}/n_grads"] > 10
        assert diffs[f"{family}/{name}/logits"] < TOL, diffs[f"{family}/{name}/logits"]
        # parameter grads (the embedding's and output layer's sum over every token: ~140 here) to 1e-5 of their size
        scale = diffs[f"{family}/{name}/grad_scale"]
        assert scale > 1 and diffs[f"{family}/{name}/grads"] < TOL * scale, (diffs[f"{family}/{name}/grads"], scale)


def test_the_node_check_names_the_key():
    from skyrl_mtp.models.families.megatron_common import check_layer_impl

    check_layer_impl("local")
    check_layer_impl("sdpa")                                   # torch 2.13 here: SDPA with enable_gqa runs
    with pytest.raises(ModelBuildError, match=r"megatron.layer_impl='transformer_engine' is invalid on this node"):
        check_layer_impl("transformer_engine")                 # no TE, no GPU here
    with pytest.raises(ModelBuildError, match=r"megatron.layer_impl='flash' is invalid; allowed: \('local', 'sdpa'"):
        check_layer_impl("flash")


def test_the_fused_swiglu_equals_the_unfused_mlp(diffs):
    assert diffs["swiglu/plain_flag"] == 0 and diffs["swiglu/switched"] >= 3   # dense and expert MLPs, every layer
    assert diffs["swiglu/logits"] < TOL, diffs["swiglu/logits"]
    scale = diffs["swiglu/grad_scale"]
    assert scale > 1 and diffs["swiglu/grads"] < TOL * scale, (diffs["swiglu/grads"], scale)
