"""The Megatron policy with pipeline parallelism (megatron.pp = 2, alone and with TP or DP; gloo processes).

Against one process running the whole model (PP=1): the same logprobs, train-step losses, grad norms and
updated weights; the decoupled draft loss still leaves the policy bitwise as it is without MTP; a checkpoint
resumes bitwise; the HF export of a checkpoint is the model's weights. Tolerances: logprobs 1e-5; losses,
grad norms and MTP metrics 1e-5 relative (the pipeline sums the squared grad norm per stage, then over stages,
in float64, where one process uses torch's clip_grad_norm_); weights 1e-4 (Adam turns last-ulp gradient
differences of near-zero entries into a fraction of the learning rate, 1e-3).
"""

import pytest
import torch
import torch.multiprocessing as mp
from pipeline_rank import run_pipeline_rank
from safetensors.torch import load_file

from skyrl_mtp.models.tiny import TinyModelSpec, build_tiny_checkpoint
from skyrl_mtp.net import free_port
from skyrl_mtp.policy.config import PolicyWorkerConfig
from skyrl_mtp.policy.megatron_policy import MegatronPolicy, reproducible_metrics
from skyrl_mtp.policy.synthetic_batch import random_dapo_batches

pytestmark = pytest.mark.integration
CFG = dict(policy_lr=1e-3, head_lr=1e-3, micro_batch_size=2, seed=0, mtp_num_depths=2)
METRICS = ("policy/loss", "policy/grad_norm", "mtp/loss", "mtp/grad_norm", "mtp/top1_agreement_pos_1",
           "mtp/top1_agreement_pos_2", "policy/clip_frac_low")


def batches():
    # 6 rows: micro-batches of 2, 2, 2 on one DP rank and 2, 1 on each of two (a remainder micro-batch too)
    return random_dapo_batches(3, 100, 6, 20, prompt_len=6, old_logprob=-4.0)


def _one_process(ckpt) -> dict:
    pol = MegatronPolicy(PolicyWorkerConfig(**CFG), str(ckpt), 0, 1, "127.0.0.1", free_port())
    bs = batches()
    out = {"logprobs": pol.compute_logprobs(bs[0]), "metrics": [pol.train_step(b, "dapo", {}) for b in bs],
           "weights": pol.export_weights()}
    pol.capture.remove()
    return out


def _pipelined(ckpt, tmp_path, **layout) -> list[dict]:
    world = 2 * layout.get("tp", 1) * layout.get("dp", 1)
    out = tmp_path / "res"
    mp.start_processes(run_pipeline_rank, nprocs=world, join=True, start_method="spawn",
                       args=(world, free_port(), str(ckpt), dict(CFG, pp=2, **layout), batches(), str(out),
                             str(tmp_path / "ck")))
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


def _assert_matches(r0: dict, ref: dict) -> None:
    for m, m_ref in zip(r0["metrics"], ref["metrics"]):
        for k in METRICS:
            assert m[k] == pytest.approx(m_ref[k], rel=1e-5, abs=1e-7), k
    for k, v in ref["weights"].items():
        torch.testing.assert_close(r0["weights"][k], v, atol=1e-4, rtol=1e-4, msg=k)


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    return _one_process(tiny_ckpt)


@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (1, 2)])
def test_pipeline_parallel_policy_matches_one_process(tiny_ckpt, reference, tmp_path, tp, dp):
    ranks = _pipelined(tiny_ckpt, tmp_path, tp=tp, dp=dp)
    ck = tmp_path / "ck"
    r0 = ranks[0]
    # the stages: one decoder layer each, the MTP block and its own head optimizer on the last one
    stages = {r["stage"] for r in ranks}
    assert stages == {(0, 0, 1, False), (1, 1, 1, True)}
    assert all(r["head_side"] == r["stage"][3] for r in ranks)
    lps = torch.cat([ranks[d * tp]["logprobs"] for d in range(dp)])   # rank d*tp: DP rank d of the first stage
    torch.testing.assert_close(lps, reference["logprobs"], atol=1e-5, rtol=1e-5)
    _assert_matches(r0, reference)
    # every rank reports its last stage's numbers (wall-clock timings are each last-stage TP rank's own)
    assert all([reproducible_metrics(m) for m in r["metrics"]] == [reproducible_metrics(m) for m in r0["metrics"]]
               for r in ranks)
    # the last stage's embedding copy equals the trained embedding (the MTP block embeds with it)
    firsts = [r for r in ranks if "embedding" in r]
    copies = [r for r in ranks if "embedding_copy" in r]
    assert len(copies) == len(firsts) == tp * dp
    assert all(torch.equal(a["embedding"], b["embedding_copy"]) for a, b in zip(firsts, copies))

    # the draft loss leaves the policy bitwise as without MTP, at PP=2 too
    for m, m_off in zip(r0["metrics"], r0["no_mtp_metrics"]):
        assert m["policy/grad_norm"] == m_off["policy/grad_norm"] and m["policy/loss"] == m_off["policy/loss"]
    trunk = {k for k in r0["no_mtp_weights"]}
    assert trunk == {k for k in r0["weights"] if not k.startswith("model.mtp_layers.")}
    assert all(torch.equal(r0["weights"][k], r0["no_mtp_weights"][k]) for k in trunk)

    # checkpoint: resumed bitwise; its HF export is the weights at save time; the draft head alone beside it
    assert r0["resumed_step"] == len(batches()) - 1
    assert reproducible_metrics(r0["resumed_metrics"]) == reproducible_metrics(r0["metrics"][-1])
    assert all(torch.equal(r0["resumed_weights"][k], v) for k, v in r0["weights"].items())
    hf = load_file(str(ck / "hf" / "model.safetensors"))
    assert hf.keys() == r0["saved_weights"].keys()
    assert all(torch.equal(hf[k], v) for k, v in r0["saved_weights"].items())
    draft = load_file(str(ck / "draft_head" / "draft_head.safetensors"))
    assert set(draft) == {k for k in hf if k.startswith("model.mtp_layers.")} and draft


def test_pipeline_parallel_hybrid_gdn_policy_matches_one_process(tmp_path):
    """Qwen3.5 (Gated DeltaNet layer on the first stage, gated attention and the MTP layer on the last)."""
    ckpt = build_tiny_checkpoint(tmp_path / "q35", TinyModelSpec(family="qwen3_5", seed=4))
    ranks = _pipelined(ckpt, tmp_path / "pp")
    assert {r["stage"] for r in ranks} == {(0, 0, 1, False), (1, 1, 1, True)}
    ref = _one_process(ckpt)
    torch.testing.assert_close(ranks[0]["logprobs"], ref["logprobs"], atol=1e-5, rtol=1e-5)
    _assert_matches(ranks[0], ref)
