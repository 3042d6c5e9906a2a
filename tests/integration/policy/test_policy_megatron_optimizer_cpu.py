"""The GPU training path (Megatron DDP fp32 grad buffers + distributed optimizer, policy and MTP head built
separately) executed for real on CPU: two gloo ranks at DP=2, real megatron-core, opted in through
``SKYRL_MTP_MEGATRON_OPTIMIZER_ON_CPU`` (policy/megatron/device.py) and run under ``cpu_shim.megatron_optimizer_on_cpu``;
on the default tiny MiMo model and on a tiny DeepSeek-V3 MoE model at expert parallel size 2 (each rank holds
half the routed experts: megatron-core's expert DDP buffers and a second, expert-parallel optimizer per side).

Checks: the policy's weights follow the torch AdamW path (same data, LR, clipping); the draft loss never
reaches the trunk (bitwise); the Adam state is sharded over the two ranks (the experts' over their
expert-data-parallel ranks: none at EP=2 of 2); a checkpoint resumes bitwise."""

import pytest
import torch
import torch.multiprocessing as mp
from parallel_rank import run_megatron_optimizer_rank

from skyrl_mtp.models.tiny import TinyModelSpec, build_tiny_checkpoint
from skyrl_mtp.net import free_port
from skyrl_mtp.policy.synthetic_batch import random_dapo_batches

pytestmark = pytest.mark.integration
# clips below the grad norms of these batches (policy 3-5, head ~0.08): clipping is exercised on both sides
CFG = dict(dp=2, policy_lr=1e-3, head_lr=1e-3, micro_batch_size=1, seed=0, policy_grad_clip=0.2, head_grad_clip=0.05,
           export_hf=False, export_draft_head=False)
STEPS = 3


def batches():
    # old logprobs near the tiny model's own (~ -log 512): ratios stay inside DAPO's clip, grads are nonzero
    return random_dapo_batches(STEPS, 200, 4, 16, prompt_len=5, old_logprob=-6.2)


@pytest.fixture(scope="module", params=["mimo", "deepseek_v3_ep2"])
def ranks(request, tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron_opt_cpu")
    out = tmp / "res"
    ckpt, cfg = tiny_ckpt, CFG
    if request.param == "deepseek_v3_ep2":
        ckpt = build_tiny_checkpoint(tmp / "ds", TinyModelSpec(family="deepseek_v3", seed=7))
        cfg = dict(CFG, ep=2)
    mp.start_processes(run_megatron_optimizer_rank,
                       args=(2, free_port(), str(ckpt), cfg, batches(), str(tmp / "ckpt"), str(out)),
                       nprocs=2, join=True, start_method="spawn")
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]


def test_megatron_optimizer_runs_on_cpu_and_follows_torch_adamw(ranks):
    r0, r1 = ranks
    assert r0["sides"] == ("MegatronSideOptimizer", "TorchSideOptimizer")
    assert r0["buffers"] == {"policy": True, "head": True}   # each DDP buffer holds exactly its side's params
    for k in r0["megatron"]:                                  # the DP all-gather leaves both ranks identical ...
        if k not in r0["experts"]:                            # ... but for the experts each holds (EP=2)
            assert torch.equal(r0["megatron"][k], r1["megatron"][k]), k
    for m, ref in zip(r0["metrics"]["megatron"], r0["metrics"]["torch"]):
        for k in ("policy/loss", "policy/grad_norm", "mtp/loss", "mtp/grad_norm"):
            assert m[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-7), k
        assert m["policy/grad_norm"] > CFG["policy_grad_clip"] and m["mtp/grad_norm"] > CFG["head_grad_clip"]
    # Both paths are fp32 Adam on DP-summed, clipped grads; they differ only in summation order
    # (reduce-scatter vs all-reduce, Megatron's grad norm vs torch's) and in the AdamW kernel (torch for-loop vs
    # fused). Measured: max |difference| 1.2e-6 after 3 steps. Adam divides by sqrt(v), so an ulp-level grad
    # difference on a near-zero entry can grow further: atol 2e-5 leaves ~15x margin and is still ~100x below
    # what one step moves every tensor (>= 2.8e-3 here): unsummed (DP-averaged) or unclipped grads, a wrong LR or
    # a head param in the policy's optimizer move entries by ~lr per step.
    worst = max((r0["megatron"][k] - r0["torch"][k]).abs().max().item() for k in r0["torch"])
    moved = min((r0["megatron"][k] - r0["init"][k]).abs().max().item() for k in r0["torch"])
    print(f"max |megatron - torch| = {worst:.3g}; smallest per-tensor max move = {moved:.3g}")
    for k, v in r0["torch"].items():
        torch.testing.assert_close(r0["megatron"][k], v, atol=2e-5, rtol=0, msg=k)
        assert not torch.equal(r0["megatron"][k], r0["init"][k]), k  # every tensor trained


def test_draft_loss_never_reaches_the_trunk(ranks):
    r0 = ranks[0]
    for k, v in r0["megatron"].items():
        if k.startswith("mtp."):
            assert not torch.equal(v, r0["no_draft"][k]), k    # the head did train on the draft loss ...
        else:
            assert torch.equal(v, r0["no_draft"][k]), k        # ... and the trunk never saw it


def test_adam_state_is_sharded_over_dp(ranks):
    for side in ("policy", "head"):
        experts = [r["expert_numel"][side] for r in ranks]    # whole on their rank (expert-data-parallel size 1)
        total = ranks[0]["numel"][side] - experts[0]
        shards = [r["shard_numel"][side]["exp_avg"] - e for r, e in zip(ranks, experts)]
        print(f"{side}: {total} dense params, Adam exp_avg elements per DP rank {shards} (+ experts {experts})")
        assert [r["shard_numel"][side]["exp_avg_sq"] for r in ranks] == [s + e for s, e in zip(shards, experts)]
        assert sum(shards) == total                            # disjoint shards covering every element once
        assert all(abs(s - total / 2) <= 0.01 * total for s in shards), shards


def test_checkpoint_resumes_bitwise(ranks):
    for r in ranks:
        for k, v in r["megatron"].items():
            assert torch.equal(r["resumed"][k], v), k
