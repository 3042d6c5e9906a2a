"""Body of one spawned rank for the TP=2 / DP=2 policy tests (must be importable by the child)."""

import torch


def run_rank(rank, world, port, ckpt, cfg_kwargs, batches, out_path):
    torch.set_num_threads(1)
    from skyrl_mtp.policy.config import PolicyWorkerConfig
    from skyrl_mtp.policy.megatron_policy import MegatronPolicy

    cfg = PolicyWorkerConfig(**cfg_kwargs)
    pol = MegatronPolicy(cfg, ckpt, rank, world, "127.0.0.1", port)
    dp_rank = rank // cfg.tp if cfg.dp > 1 else 0

    def shard(b):
        n = b["input_ids"].shape[0] // cfg.dp
        return {k: v[dp_rank * n:(dp_rank + 1) * n] for k, v in b.items()}

    lps = pol.compute_logprobs(shard(batches[0]))
    metrics = [pol.train_step(shard(b), "dapo", {}) for b in batches]
    weights = pol.export_weights()
    if rank == 0 or cfg.dp > 1:
        torch.save({"logprobs": lps, "metrics": metrics, "weights": weights if rank == 0 else None},
                   f"{out_path}.{rank}")
    pol.shutdown()
