"""Expert parallelism on CPU/gloo with two real megatron-core ranks: a DeepSeek-V3 and a Qwen3.5-MoE tiny model (8
routed experts per MoE layer, the MTP layer's included; Qwen3.5-MoE's trunk experts stored packed) trained at EP=2 (each rank holds 4 experts and exchanges
tokens with megatron-core's all-gather dispatcher) equals EP=1 (every rank holds all 8): logprobs, policy and
draft losses, grad norms, router statistics, the last step's gradient of every parameter, and the HF export
gathered over the expert-parallel ranks."""

import pytest
import torch
import torch.multiprocessing as mp
from parallel_rank import run_expert_parallel_rank

from skyrl_mtp.models.tiny import TinyModelSpec, build_tiny_checkpoint
from skyrl_mtp.net import free_port
from skyrl_mtp.policy.synthetic_batch import random_dapo_batches

pytestmark = pytest.mark.integration
CFG = dict(policy_lr=1e-3, head_lr=1e-3, micro_batch_size=2, seed=0, mtp_num_depths=2, dp=2, moe_aux_loss_coeff=0.01)
METRICS = ("policy/loss", "policy/grad_norm", "mtp/loss", "mtp/grad_norm", "mtp/top1_agreement_pos_1",
           "mtp/top1_agreement_pos_2", "moe/tokens_per_expert_max", "moe/load_max_over_mean", "moe/load_cv",
           "mtp/moe_tokens_per_expert_max")


@pytest.fixture(scope="module", params=("deepseek_v3", "qwen3_5_moe"))
def ds_ckpt(request, tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp(request.param), TinyModelSpec(family=request.param, seed=6))


def _run(ckpt, tmp_path, ep: int) -> list[dict]:
    out = tmp_path / f"ep{ep}"
    batches = random_dapo_batches(2, 100, 4, 20, prompt_len=6, old_logprob=-4.0)
    mp.start_processes(run_expert_parallel_rank, args=(2, free_port(), str(ckpt), dict(CFG, ep=ep), batches, str(out)),
                       nprocs=2, join=True, start_method="spawn")
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]


def test_ep2_equals_ep1(ds_ckpt, tmp_path):
    one, two = _run(ds_ckpt, tmp_path, 1), _run(ds_ckpt, tmp_path, 2)
    assert [r["experts"] for r in one] == [list(range(8))] * 2
    assert [r["experts"] for r in two] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for a, b in zip(one, two):
        torch.testing.assert_close(b["logprobs"], a["logprobs"], atol=1e-5, rtol=1e-5)
        for step, (ma, mb) in enumerate(zip(a["metrics"], b["metrics"])):
            for k in METRICS:
                assert mb[k] == pytest.approx(ma[k], rel=1e-4, abs=1e-6), (step, k)
            print(f"\nstep {step}: " + ", ".join(f"{k} {ma[k]:.6g} / {mb[k]:.6g}" for k in METRICS[:4]))
    # the last step's gradients: EP=1 ranks hold every parameter (DP all-reduced); EP=2 ranks hold the dense
    # ones and their own experts (all-reduced over the ranks holding the same experts: none here)
    union = {**two[0]["grads"], **two[1]["grads"]}
    assert union.keys() == one[0]["grads"].keys() and len(union) > len(two[0]["grads"])
    worst = max(float((union[n] - g).abs().max()) for n, g in one[0]["grads"].items())
    print(f"largest gradient difference EP=2 vs EP=1: {worst:.2e} over {len(union)} parameters")
    for n, g in one[0]["grads"].items():
        torch.testing.assert_close(union[n], g, atol=1e-6, rtol=1e-5, msg=n)
    wa, wb = one[0]["weights"], two[0]["weights"]   # the HF export, EP-gathered on every rank
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-4, rtol=1e-4, msg=k)
