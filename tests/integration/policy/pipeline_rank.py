"""Body of one spawned rank of the pipeline-parallel policy tests (must be importable by the child)."""

import torch


def run_pipeline_rank(rank, world, port, ckpt, cfg_kwargs, batches, out_path, ckpt_dir):
    """Train `batches` with `cfg_kwargs` (pp > 1, maybe tp / dp); checkpoint before the last step and resume a
    fresh policy from it; train the same batches with MTP disabled (the isolation reference)."""
    torch.set_num_threads(1)
    from skyrl_mtp.policy.config import PolicyWorkerConfig
    from skyrl_mtp.policy.megatron_policy import MegatronPolicy

    def build(**overrides):
        return MegatronPolicy(PolicyWorkerConfig(**{**cfg_kwargs, **overrides}), ckpt, rank, world, "127.0.0.1", port)

    pol = build()
    cfg = pol.cfg
    dp_rank = (rank // cfg.tp) % cfg.dp

    def shard(b):
        n = b["input_ids"].shape[0] // cfg.dp
        return {k: v[dp_rank * n:(dp_rank + 1) * n] for k, v in b.items()}

    out = {"stage": (pol.layout.pp_rank, pol.layout.layer_offset, pol.layout.num_layers, pol.layout.has_mtp),
           "head_side": pol.head_side is not None}
    out["logprobs"] = pol.compute_logprobs(shard(batches[0]))
    out["metrics"] = []
    for i, b in enumerate(batches):
        if i == len(batches) - 1:
            pol.save_checkpoint(ckpt_dir)
            out["saved_weights"] = pol.export_weights()
        out["metrics"].append(pol.train_step(shard(b), "dapo", {}))
    out["weights"] = pol.export_weights()
    if pol.layout.embedding_is_copy:   # the MTP block's copy follows the trained embedding
        out["embedding_copy"] = pol.model.embedding.word_embeddings.weight.detach().clone()
    if pol.layout.is_first:
        out["embedding"] = pol.model.embedding.word_embeddings.weight.detach().clone()

    resumed = build()
    resumed.load_checkpoint(ckpt_dir)
    out["resumed_step"] = resumed.step
    out["resumed_metrics"] = resumed.train_step(shard(batches[-1]), "dapo", {})
    out["resumed_weights"] = resumed.export_weights()

    no_mtp = build(mtp_enabled=False)
    out["no_mtp_metrics"] = [no_mtp.train_step(shard(b), "dapo", {}) for b in batches]
    out["no_mtp_weights"] = no_mtp.export_weights()
    torch.save(out, f"{out_path}.{rank}")
    for p in (pol, resumed):
        if p.capture is not None:
            p.capture.remove()
    pol.shutdown()
