"""Supervised warm start of a tiny policy, cached on disk.

A freshly initialised tiny model never produces a correct answer, so RL would have no signal.
This stage trains the policy trunk (not the MTP head: it must start untrained so the run shows
the drafter catching up) with an SFT loss on the task's reference responses, on the same Megatron
worker class the RL loop uses, and writes an HF checkpoint whose MTP weights are the base
checkpoint's. The result is keyed by everything that determines it and reused by later runs.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from skyrl_mtp.algorithms.train_batch import Rollout, build_train_batch
from skyrl_mtp.cache_dirs import is_complete, private_build_dir, publish
from skyrl_mtp.models.families.packed_experts import PackedExperts

COPY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "special_tokens_map.json")


@dataclass(frozen=True)
class SFTExample:
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int] | None = None   # 0 on tool output (not trained)


@dataclass(frozen=True)
class WarmStartPlan:
    steps: int
    lr: float
    batch_size: int
    seed: int
    micro_batch_size: int


def cache_key(base_ckpt: Path, plan: WarmStartPlan, examples: list[SFTExample]) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        p = base_ckpt / name
        if p.exists():
            h.update(hashlib.sha256(p.read_bytes()).digest())
    h.update(json.dumps(asdict(plan), sort_keys=True).encode())
    h.update(json.dumps([asdict(e) for e in examples]).encode())
    return h.hexdigest()[:16]


def sft_batches(examples: list[SFTExample], plan: WarmStartPlan, pad_id: int):
    rng = random.Random(plan.seed)
    order: list[int] = []
    for _ in range(plan.steps):
        if len(order) < plan.batch_size:
            more = list(range(len(examples)))
            rng.shuffle(more)
            order += more
        idx, order = order[:plan.batch_size], order[plan.batch_size:]
        rollouts = [Rollout(examples[i].prompt_ids, examples[i].response_ids, [0.0] * len(examples[i].response_ids),
                            "stop", response_loss_mask=examples[i].response_mask) for i in idx]
        batch = build_train_batch(rollouts, torch.zeros(len(rollouts)), pad_id)
        batch.pop("rollout_logprobs")
        batch.pop("advantages")
        yield batch


def write_hf_checkpoint(out: Path, base_ckpt: Path, trunk: dict[str, torch.Tensor]) -> None:
    """HF dir = base checkpoint's files with the trunk tensors replaced (MTP tensors kept from the base)."""
    base = {}
    for f in sorted(base_ckpt.glob("*.safetensors")):
        base.update(load_file(str(f)))
    packed = PackedExperts({k: tuple(t.shape) for k, t in base.items()})
    if packed:   # the policy exports experts one by one; the base stores them packed
        trunk = packed.pack(trunk)
    unknown = sorted(set(trunk) - set(base))
    if unknown:
        raise ValueError(f"warm-start export has tensors the base checkpoint lacks: {unknown[:5]}")
    merged = {k: (trunk[k] if k in trunk else v).contiguous() for k, v in base.items()}
    out.mkdir(parents=True, exist_ok=True)
    for name in COPY_FILES:
        if (base_ckpt / name).exists():
            shutil.copy2(base_ckpt / name, out / name)
    save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})


def warm_start(base_ckpt: Path, cache_root: Path, examples: list[SFTExample], plan: WarmStartPlan, pad_id: int,
               start_worker: Callable[[Path, float], object], log: Callable[[str], None] = print) -> Path:
    """Return a cached warm-started HF checkpoint, training it first if needed.

    start_worker(hf_path, lr) -> a started PolicyWorker actor handle (MTP disabled).
    """
    import ray

    if not examples:
        raise ValueError("warm start needs at least one supervised example")
    final = cache_root / f"warm-{cache_key(base_ckpt, plan, examples)}"
    if is_complete(final):
        log(f"warm start: reusing {final}")
        return final
    worker = start_worker(base_ckpt, plan.lr)
    try:
        losses = []
        for step, batch in enumerate(sft_batches(examples, plan, pad_id)):
            m = ray.get(worker.train_step.remote(batch, policy_loss="sft", train_head=False))
            losses.append(m["policy/loss"])
            if step % max(plan.steps // 5, 1) == 0 or step == plan.steps - 1:
                log(f"warm start step {step + 1}/{plan.steps}: sft loss {m['policy/loss']:.4f}")
        trunk = ray.get(worker.export_weights.remote())
    finally:
        try:
            ray.get(worker.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - the actor is killed next anyway
            pass
        ray.kill(worker)
    tmp = private_build_dir(final)
    try:
        write_hf_checkpoint(tmp, base_ckpt, trunk)
        (tmp / "warm_start.json").write_text(json.dumps({"plan": asdict(plan), "losses": losses}, indent=1))
        return publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
