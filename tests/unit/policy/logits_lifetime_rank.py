"""Body of the spawned process of test_logits_lifetime.py: a CPU MegatronPolicy on a tiny MiMo checkpoint records a
weak reference to every micro-batch's logits and, when each optimizer steps, which of them are still alive."""

from __future__ import annotations

import weakref

import torch


def run(_idx: int, ckpt: str, out_path: str) -> None:
    from skyrl_mtp.net import free_port
    from skyrl_mtp.policy.config import PolicyWorkerConfig
    from skyrl_mtp.policy.megatron_policy import MegatronPolicy
    from skyrl_mtp.policy.synthetic_batch import random_dapo_batch

    torch.set_num_threads(1)
    pol = MegatronPolicy(PolicyWorkerConfig(micro_batch_size=2, policy_lr=1e-4, head_lr=1e-4), ckpt, 0, 1,
                         "127.0.0.1", free_port())
    refs: list[weakref.ref] = []
    forward, policy_step, head_step = pol._forward, pol.policy_side.step, pol.head_side.step

    def recording_forward(mb):
        logits = forward(mb)
        refs.append(weakref.ref(logits))
        return logits

    seen: dict[str, list[int]] = {}

    def at(name, step):
        def wrapped():
            seen.setdefault(name, []).append(sum(r() is not None for r in refs))
            return step()
        return wrapped

    pol._forward = recording_forward
    pol.policy_side.step, pol.head_side.step = at("policy", policy_step), at("head", head_step)
    batch = random_dapo_batch(torch.Generator().manual_seed(0), 4, 16, vocab=pol.args.vocab_size)
    res = {}
    for head in (False, True):
        refs.clear()
        seen.clear()
        pol.train_step(batch, "dapo", {}, train_head=head)
        res[f"head={head}"] = {"micro_batches": len(refs), "alive_at": dict(seen)}
    pol.shutdown()
    torch.save(res, out_path)
