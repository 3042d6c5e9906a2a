"""Body of the spawned process of test_fused_adam.py's Megatron case: a CPU rank on the Megatron DDP + distributed
optimizer path (the GPU path's code, SKYRL_MTP_MEGATRON_OPTIMIZER_ON_CPU=1) trains three steps with megatron-core's
torch AdamW as built and again switched to the fused kernel; returns both runs' weights and last metrics."""

from __future__ import annotations

import os

import torch


def run(_idx: int, ckpt: str, out_path: str) -> None:
    os.environ["SKYRL_MTP_MEGATRON_OPTIMIZER_ON_CPU"] = "1"
    from skyrl_mtp.net import free_port
    from skyrl_mtp.policy.config import PolicyWorkerConfig
    from skyrl_mtp.policy.megatron.distributed_optimizer import fuse_torch_adam
    from skyrl_mtp.policy.megatron_policy import MegatronPolicy
    from skyrl_mtp.policy.synthetic_batch import random_dapo_batches

    torch.set_num_threads(1)
    res = {}
    for fused in (False, True):
        pol = MegatronPolicy(PolicyWorkerConfig(micro_batch_size=2, policy_lr=1e-3, head_lr=1e-3, weight_decay=0.1),
                             ckpt, 0, 1, "127.0.0.1", free_port())
        switched = [fuse_torch_adam(o.optimizer) for side in (pol.policy_side, pol.head_side) for o in side.inner] \
            if fused else []
        for batch in random_dapo_batches(3, 0, 4, 16, vocab=pol.args.vocab_size):
            batch["old_logprobs"] = pol.compute_logprobs(batch)   # ratios near 1: the loss has gradients
            metrics = pol.train_step(batch, "dapo", {})
        res[fused] = {"weights": {n: p.detach().clone() for n, p in pol.model.named_parameters()},
                      "metrics": metrics, "switched": switched, "side": type(pol.policy_side).__name__}
        pol.shutdown()
    torch.save(res, out_path)
