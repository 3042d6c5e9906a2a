"""Driver of the two-node policy test (run as its own process, connected to the test's Ray cluster).

Runs the same DP=2 policy twice on the same batches: both ranks on the head node, then rank 0 on the
second node (127.0.0.2) and rank 1 on the head. Saves, per run, where the ranks met and ran, the
train-step metrics and the exported weights.
"""

import sys

import ray
import torch

from skyrl_mtp.policy.config import PolicyWorkerConfig
from skyrl_mtp.policy.synthetic_batch import random_dapo_batches
from skyrl_mtp.policy.worker import node_address
from skyrl_mtp.trainer.policy_group import PolicyGroup


def batches():
    return random_dapo_batches(2, 200, 4, 16, prompt_len=5, old_logprob=-4.0)


def run(ckpt: str, placement: list[str]) -> dict:
    cfg = PolicyWorkerConfig(policy_lr=1e-3, head_lr=1e-3, micro_batch_size=2, seed=0, dp=2)
    group = PolicyGroup.create(cfg, ckpt, world_size=2, tp=1, pp=1, cp=1, dp=2, num_cpus=1,
                               per_rank_options=[{"resources": {res: 1}} for res in placement])
    try:
        nodes = [ray.get(w.__ray_call__.remote(lambda _w: node_address())) for w in group.workers]
        metrics = [group.train_step(b, policy_loss="dapo", policy_loss_kwargs={}) for b in batches()]
        return {"master_addr": group.master_addr, "nodes": nodes, "metrics": metrics,
                "weights": group.export_weights()}
    finally:
        group.shutdown()


if __name__ == "__main__":
    address, ckpt, out = sys.argv[1:4]
    ray.init(address=address, log_to_driver=False)
    head = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"] and "skyrl_node_a" in n["Resources"]]
    results = {"head_address": head[0] if len(head) == 1 else head,
               "one_node": run(ckpt, ["skyrl_node_a", "skyrl_node_a"]),
               "two_nodes": run(ckpt, ["skyrl_node_b", "skyrl_node_a"])}
    torch.save(results, out)
    ray.shutdown()
