"""Body of one spawned single-rank policy process for the GPU policy tests (importable by the child).

``device`` "cpu" hides the GPUs before CUDA is initialised, so the device seam picks the CPU path; "cuda"
leaves them visible (rank 0 of world size 1 takes cuda:0).
"""

import os


def run_scenario(_idx, scenario, device, ckpt, cfg_kwargs, batches, out_path):
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)  # e.g. the embedding backward's atomics

    from skyrl_mtp.net import free_port
    from skyrl_mtp.policy.config import PolicyWorkerConfig
    from skyrl_mtp.policy.megatron_policy import MegatronPolicy, reproducible_metrics

    pol = MegatronPolicy(PolicyWorkerConfig(**cfg_kwargs), ckpt, 0, 1, "127.0.0.1", free_port())
    res = {"device": str(pol.device.device), "side": type(pol.policy_side).__name__,
           "adam_fused": bool(getattr(pol.policy_side, "torch_adam_fused", False))}
    if scenario == "logprobs":
        res["logprobs"] = pol.compute_logprobs(batches[0])
    elif scenario == "train":
        res["metrics"] = [pol.train_step(b, "dapo", {}) for b in batches]
        res["main"] = dict(pol.iter_hf_weights("main"))
        res["draft"] = dict(pol.iter_hf_weights("draft"))
        if pol.device.megatron_optimizer:
            from skyrl_mtp.policy.megatron.distributed_optimizer import ddp_buffer_params

            pol_buf, head_buf = ddp_buffer_params(pol.policy_side.ddp), ddp_buffer_params(pol.head_side.ddp)
            res["buffers_disjoint"] = not (pol_buf & head_buf)
            res["policy_buffer_is_policy"] = pol_buf == set(pol.policy_params)
            res["head_buffer_is_head"] = head_buf == set(pol.head_params)
    elif scenario == "checkpoint":
        pol.train_step(batches[0], "dapo", {})
        pol.save_checkpoint(f"{out_path}.ck")
        saved = {n: p.detach().cpu().clone() for n, p in pol.model.named_parameters()}
        pol.train_step(batches[1], "dapo", {})
        pol.load_checkpoint(f"{out_path}.ck")
        res["restored_equal"] = all(torch.equal(saved[n], p.detach().cpu()) for n, p in pol.model.named_parameters())
        after_a = pol.train_step(batches[1], "dapo", {})
        pol.load_checkpoint(f"{out_path}.ck")
        after_b = pol.train_step(batches[1], "dapo", {})
        res["resumed_step_equal"] = reproducible_metrics(after_a) == reproducible_metrics(after_b)
    torch.save(res, out_path)
    pol.shutdown()
