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
    if pol.drafter is not None:
        weights.update(pol.iter_hf_weights("draft"))
    if rank == 0 or cfg.dp > 1:
        torch.save({"logprobs": lps, "metrics": metrics, "weights": weights if rank == 0 else None},
                   f"{out_path}.{rank}")
    pol.shutdown()


def run_megatron_optimizer_rank(rank, world, port, ckpt, cfg_kwargs, batches, ckpt_dir, out_path):
    """One DP rank of the CPU-emulated Megatron optimizer test: the same DP shard of each batch trains
    (1) the Megatron DDP + distributed optimizer path, (2) the torch AdamW path, (3) the Megatron path with
    the draft loss weighted 0; then (1) is checkpointed after ``len(batches) - 1`` steps, resumed into a fresh
    (4), and both take the last step."""
    import os

    torch.set_num_threads(1)
    from skyrl_mtp.policy.config import PolicyWorkerConfig
    from skyrl_mtp.policy.megatron.device import CPU_MEGATRON_OPTIMIZER_ENV
    from skyrl_mtp.policy.megatron.distributed_optimizer import ddp_buffer_params
    from skyrl_mtp.policy.megatron_policy import MegatronPolicy

    def build(megatron: bool, **overrides):
        os.environ[CPU_MEGATRON_OPTIMIZER_ENV] = "1" if megatron else "0"
        try:
            return MegatronPolicy(PolicyWorkerConfig(**{**cfg_kwargs, **overrides}), ckpt, rank, world,
                                  "127.0.0.1", port)
        finally:
            os.environ.pop(CPU_MEGATRON_OPTIMIZER_ENV)

    def shard(b):
        n = b["input_ids"].shape[0] // world
        return {k: v[rank * n:(rank + 1) * n] for k, v in b.items()}

    def weights(pol):
        return {n: p.detach().clone() for n, p in pol.model.named_parameters()}

    meg, ref, no_draft = build(True), build(False), build(True, mtp_loss_weight=0.0)
    out = {"sides": (type(meg.policy_side).__name__, type(ref.policy_side).__name__)}
    policy_buf, head_buf = ddp_buffer_params(meg.policy_side.ddp), ddp_buffer_params(meg.head_side.ddp)
    out["buffers"] = {"policy": policy_buf == set(meg.policy_params), "head": head_buf == set(meg.head_params)}

    def shard_numel(side):
        state = side.torch_optimizer.state
        return {k: sum(s[k].numel() for s in state.values()) for k in ("exp_avg", "exp_avg_sq")}

    init = weights(meg)
    out["metrics"] = {"megatron": [], "torch": []}
    for i, b in enumerate(batches):
        if i == len(batches) - 1:
            meg.save_checkpoint(ckpt_dir)
        out["metrics"]["megatron"].append(meg.train_step(shard(b), "dapo", {}))
        out["metrics"]["torch"].append(ref.train_step(shard(b), "dapo", {}))
        no_draft.train_step(shard(b), "dapo", {})
    out["init"], out["megatron"], out["torch"], out["no_draft"] = init, weights(meg), weights(ref), weights(no_draft)
    out["shard_numel"] = {"policy": shard_numel(meg.policy_side), "head": shard_numel(meg.head_side)}
    out["numel"] = {"policy": sum(p.numel() for p in meg.policy_params),
                    "head": sum(p.numel() for p in meg.head_params)}
    out["expert_numel"] = {side: sum(p.numel() for p in params if not getattr(p, "allreduce", True))
                           for side, params in (("policy", meg.policy_params), ("head", meg.head_params))}
    out["experts"] = {n for n, p in meg.model.named_parameters() if not getattr(p, "allreduce", True)}
    resumed = build(True)
    resumed.load_checkpoint(ckpt_dir)
    resumed.train_step(shard(batches[-1]), "dapo", {})
    out["resumed"] = weights(resumed)
    torch.save(out, f"{out_path}.{rank}")
    for pol in (meg, ref, no_draft, resumed):
        pol.capture.remove()
    meg.shutdown()


def run_expert_parallel_rank(rank, world, port, ckpt, cfg_kwargs, batches, out_path):
    """One DP rank of the expert-parallel comparison: logprobs, train-step metrics, the last step's gradients
    (by GLOBAL Megatron name: under EP a rank's experts are numbered locally) and the HF export."""
    torch.set_num_threads(1)
    from skyrl_mtp.policy.config import PolicyWorkerConfig
    from skyrl_mtp.policy.megatron_policy import MegatronPolicy

    cfg = PolicyWorkerConfig(**cfg_kwargs)
    pol = MegatronPolicy(cfg, ckpt, rank, world, "127.0.0.1", port)

    def shard(b):
        n = b["input_ids"].shape[0] // world
        return {k: v[rank * n:(rank + 1) * n] for k, v in b.items()}

    lps = pol.compute_logprobs(shard(batches[0]))
    metrics = [pol.train_step(shard(b), "dapo", {}) for b in batches]
    global_name = {id(r): g for g, r in pol.global_rules.items()}
    params = dict(pol.model.named_parameters())
    grads = {global_name[id(rule)]: params[local].grad.clone() for local, rule in pol.weight_rules.items()
             if local in params and params[local].grad is not None}
    weights = pol.export_weights()
    torch.save({"logprobs": lps, "metrics": metrics, "grads": grads, "weights": weights if rank == 0 else None,
                "experts": sorted({r.expert for r in pol.weight_rules.values() if r.expert is not None})},
               f"{out_path}.{rank}")
    pol.shutdown()
