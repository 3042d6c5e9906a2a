"""PolicyWorker as a Ray actor: init from an HF checkpoint, logprobs, train step, weight export."""

import pytest
import torch

from skyrl_mtp.policy.config import PolicyWorkerConfig
from skyrl_mtp.policy.megatron_policy import load_hf_weights

pytestmark = pytest.mark.integration


def test_policy_worker_actor(ray_local, tiny_ckpt, tmp_path):
    from skyrl_mtp.net import free_port
    from skyrl_mtp.policy.worker import PolicyWorker

    # exactly the calls the trainer makes
    w = PolicyWorker.options(num_cpus=1).remote(
        PolicyWorkerConfig(policy_lr=1e-3, head_lr=1e-3, micro_batch_size=2), str(tiny_ckpt), 0, 1,
        "127.0.0.1", free_port())
    try:
        assert ray_local.get(w.ping.remote()) == 0
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 512, (2, 16), generator=g)
        lm = torch.zeros(2, 16)
        lm[:, 4:] = 1
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": lm,
                 "old_logprobs": torch.full((2, 16), -5.0), "advantages": torch.ones(2, 16)}
        lp = ray_local.get(w.compute_logprobs.remote(batch))
        assert lp.shape == (2, 16) and (lp[:, 1:] < 0).all() and (lp[:, 0] == 0).all()
        sft = ray_local.get(w.train_step.remote({k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask")},
                                                 policy_loss="sft", train_head=False))
        assert sft["policy/loss"] > 0 and not any(k.startswith("mtp/") for k in sft)
        m = ray_local.get(w.train_step.remote(batch, policy_loss="dapo", policy_loss_kwargs={
            "eps_clip_low": 0.2, "eps_clip_high": 0.28, "dual_clip_c": 3.0, "loss_reduction": "token_mean"}))
        assert m["policy/grad_norm"] > 0 and m["mtp/grad_norm"] > 0 and "mtp/top1_agreement_pos_1" in m
        ray_local.get(w.save_checkpoint.remote(str(tmp_path / "ck")))
        ray_local.get(w.load_checkpoint.remote(str(tmp_path / "ck")))
        assert (tmp_path / "ck" / "hf" / "model.safetensors").is_file()
        weights = ray_local.get(w.export_weights.remote())
        src = load_hf_weights(tiny_ckpt)
        assert weights.keys() == src.keys()
        assert not torch.equal(weights["model.layers.0.mlp.up_proj.weight"], src["model.layers.0.mlp.up_proj.weight"])
        assert not torch.equal(weights["model.mtp_layers.0.input_proj.weight"], src["model.mtp_layers.0.input_proj.weight"])
        ray_local.get(w.shutdown.remote())
    finally:
        ray_local.kill(w)
