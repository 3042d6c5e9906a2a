"""One rank of the Megatron policy: forward/logprobs, decoupled policy + MTP-head training step,
weight export and checkpoints. ``PolicyWorker`` (worker.py) is this class as a Ray actor."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from .batch_layout import REQUIRED_TRAIN_KEYS, micro_batches, prepare, validate_batch
from .config import PolicyWorkerConfig
from .megatron import checkpoint as ckpt
from .megatron.hf_bridge import hf_to_megatron, load_into_model, megatron_to_hf
from .megatron.model_builder import HFModelArgs, ModelBuildError, build_gpt_model, resolve_mtp_layers
from .megatron.optimizers import (
    allreduce_grads,
    build_optimizer,
    clip_grad_norm,
    split_params,
    warmup_schedule,
)
from .megatron.parallel_state import init_distributed

POLICY_LOSSES = tuple(REQUIRED_TRAIN_KEYS)  # "dapo" (RL), "sft" (warm start)


def load_hf_weights(hf_path: str | Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(hf_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in HF checkpoint {str(hf_path)!r}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _sequences_with_tokens(loss_mask: torch.Tensor) -> float:
    return float((loss_mask.float().sum(dim=1) > 0).sum())


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] logprob of token t+1 stored at index t+1 (index 0 is 0); logits may be a TP vocab shard."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    target = torch.zeros_like(input_ids)
    target[:, :-1] = input_ids[:, 1:]
    # Megatron's cross-entropy works in place on its input: always hand it a fresh [S, B, V] float32 copy
    # (``.contiguous()`` alone would alias the logits when B == 1, and they are still the MTP teacher).
    sbv = logits.transpose(0, 1)
    work = torch.empty(sbv.shape, dtype=torch.float32, device=logits.device).copy_(sbv)
    nll = vocab_parallel_cross_entropy(work, target.t().contiguous()).t()
    lp = torch.zeros_like(nll)
    lp[:, 1:] = -nll[:, :-1]
    return lp


class MegatronPolicy:
    def __init__(self, cfg: PolicyWorkerConfig, hf_path: str, rank: int, world_size: int,
                 master_addr: str, master_port: int):
        if cfg.tp * cfg.dp != world_size:
            raise ValueError(f"PolicyWorkerConfig tp*dp = {cfg.tp}*{cfg.dp} must equal world_size={world_size}")
        self.cfg, self.hf_path, self.rank = cfg, str(hf_path), rank
        self.args = HFModelArgs.from_checkpoint(hf_path)
        if cfg.mtp_enabled and self.args.num_nextn_predict_layers == 0:
            raise ModelBuildError(
                f"mtp_enabled=True but the checkpoint {hf_path!r} has num_nextn_predict_layers=0 (no MTP layers); "
                "set mtp_enabled=False or use a checkpoint with an MTP head")
        self.mtp_layers = resolve_mtp_layers(self.args, cfg.mtp_num_layers, cfg.mtp_enabled)
        hf = load_hf_weights(hf_path)  # read before the expensive distributed/model setup: fail fast
        from ..mtp.native_loss_patch import disable_native_mtp_loss

        init_distributed(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
                         tp=cfg.tp, seed=cfg.seed)
        from megatron.core import parallel_state as ps

        disable_native_mtp_loss()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.model = build_gpt_model(self.args, mtp_num_layers=self.mtp_layers, tp=cfg.tp, dtype=cfg.dtype)
        load_into_model(self.model, hf_to_megatron(hf, self.args, self.mtp_layers, tp_rank=self.tp_rank, tp_size=cfg.tp))
        policy, head = split_params(self.model)
        self.policy_params = [p for _, p in policy]
        self.head_params = [p for _, p in head]
        self.policy_opt = build_optimizer(self.policy_params, lr=cfg.policy_lr, weight_decay=cfg.weight_decay,
                                          betas=cfg.betas, eps=cfg.eps)
        self.policy_sched = warmup_schedule(self.policy_opt, cfg.lr_warmup_steps)
        self.head_opt = self.head_sched = None
        self.capture = None
        if self.mtp_layers > 0:
            from ..mtp.capture import MTPInputCapture

            self.head_opt = build_optimizer(self.head_params, lr=cfg.head_lr, weight_decay=cfg.weight_decay,
                                            betas=cfg.betas, eps=cfg.eps)
            self.head_sched = warmup_schedule(self.head_opt, cfg.lr_warmup_steps)
            self.capture = MTPInputCapture(self.model)
        self.step = 0

    # ------------------------------------------------------------------ forward
    def _forward(self, mb: dict) -> torch.Tensor:
        return self.model(mb["input_ids"], mb["position_ids"], mb["megatron_mask"])  # [B, S, V_local]

    @torch.no_grad()
    def compute_logprobs(self, batch: dict) -> torch.Tensor:
        validate_batch(batch, ("input_ids", "attention_mask"))
        batch = prepare(batch)
        self.model.eval()
        out = []
        for mb in micro_batches(batch, self.cfg.micro_batch_size):
            out.append(token_logprobs(self._forward(mb), mb["input_ids"]))
            if self.capture:
                self.capture.clear()
        return torch.cat(out, 0)

    # ------------------------------------------------------------------ training
    def _global_sum(self, x: float) -> float:
        t = torch.tensor(float(x), dtype=torch.float64)
        if dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(t, group=self.dp_group)
        return float(t)

    def _policy_loss(self, name: str, kw: dict, mb: dict, lp: torch.Tensor, counts: dict):
        """(loss of this micro-batch scaled so the sum over micro-batches and DP ranks is the batch loss,
        loss-function metrics)."""
        if name == "sft":
            loss = -(lp * mb["loss_mask"].to(lp.dtype)).sum() / counts["tokens"]
            return loss, {}
        from ..algorithms.policy_loss import dapo_policy_loss

        loss, metrics = dapo_policy_loss(lp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"],
                                         global_num_tokens=counts["tokens"], **kw)
        if kw.get("loss_reduction", "token_mean") != "token_mean":
            # per-sequence reductions average over the micro-batch's sequences: rescale to the global count
            loss = loss * (float(_sequences_with_tokens(mb["loss_mask"])) / counts["sequences"])
        return loss, metrics

    def train_step(self, batch: dict, policy_loss: str = "dapo", policy_loss_kwargs: dict | None = None,
                   train_head: bool = True) -> dict[str, float]:
        """One optimizer step of the policy (``policy_loss``: "dapo" or "sft") and, if the model has MTP
        layers and ``train_head``, one step of the MTP head on the decoupled draft loss of the same forward.

        ``train_head=False`` leaves the head, its optimizer and its LR schedule untouched (e.g. a warm
        start of the policy that keeps the head untrained); the policy update is the same either way.
        """
        if policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss={policy_loss!r} is not supported; allowed: {POLICY_LOSSES}")
        kw = dict(policy_loss_kwargs or {})
        if policy_loss == "sft" and kw:
            raise ValueError(f"policy_loss='sft' takes no policy_loss_kwargs; got {sorted(kw)}")
        if not isinstance(train_head, bool):
            raise ValueError(f"train_head={train_head!r} is invalid: expected True or False")
        validate_batch(batch, REQUIRED_TRAIN_KEYS[policy_loss])
        batch = prepare(batch)
        self.model.train()
        head_on = self.capture is not None and train_head
        counts = {"tokens": max(self._global_sum(batch["loss_mask"].float().sum()), 1.0),
                  "sequences": max(self._global_sum(_sequences_with_tokens(batch["loss_mask"])), 1.0)}
        spec, n_draft = None, 0.0
        if head_on:
            from ..mtp.draft_head import DraftLossSpec
            from ..mtp.masks import draft_position_mask

            spec = DraftLossSpec(self.cfg.mtp_loss_type, self.cfg.mtp_num_depths, self.cfg.mtp_loss_topk,
                                 self.cfg.mtp_loss_chunk_size)
            for d in range(1, spec.num_depths + 1):
                n_draft += float(draft_position_mask(batch["loss_mask"], d, batch.get("segment_ids")).sum())
            n_draft = max(self._global_sum(n_draft), 1.0)
            self.head_opt.zero_grad(set_to_none=True)
        self.policy_opt.zero_grad(set_to_none=True)
        fn_metrics: dict[str, float] = {}
        depth_stats: list[list[float]] = []
        policy_loss_total = 0.0
        for mb in micro_batches(batch, self.cfg.micro_batch_size):
            logits = self._forward(mb)
            lp = token_logprobs(logits, mb["input_ids"])
            loss, m = self._policy_loss(policy_loss, kw, mb, lp, counts)
            loss.backward()
            policy_loss_total += float(loss.detach())
            weight = float(mb["loss_mask"].float().sum())  # loss-function metrics: token-weighted mean
            for k, v in m.items():
                key = k if "/" in k else f"policy/{k}"
                fn_metrics[key] = fn_metrics.get(key, 0.0) + float(v) * weight
            if not head_on:
                if self.capture is not None:
                    self.capture.clear()
                continue
            from ..mtp.draft_head import compute_draft_loss

            res = compute_draft_loss(self.model, self.capture.take(), logits, mb, spec, self.args.vocab_size)
            del logits, lp
            if res.loss_sum.requires_grad:
                (res.loss_sum * (self.cfg.mtp_loss_weight / n_draft)).backward()
            depth_stats += [[0.0, 0.0, 0.0] for _ in range(len(res.per_depth) - len(depth_stats))]
            for acc, vals in zip(depth_stats, res.per_depth):
                for i in range(3):
                    acc[i] += vals[i]
        metrics = {k: self._global_sum(v) / counts["tokens"] for k, v in fn_metrics.items()}
        allreduce_grads(self.policy_params, self.dp_group)
        metrics["policy/loss"] = self._global_sum(policy_loss_total)
        metrics["policy/grad_norm"] = clip_grad_norm(self.policy_params, self.cfg.policy_grad_clip, self.tp_group)
        metrics["policy/lr"] = self.policy_sched.get_last_lr()[0]
        self.policy_opt.step()
        self.policy_sched.step()
        if head_on:
            allreduce_grads(self.head_params, self.dp_group)
            metrics["mtp/grad_norm"] = clip_grad_norm(self.head_params, self.cfg.head_grad_clip, self.tp_group)
            metrics["mtp/lr"] = self.head_sched.get_last_lr()[0]
            self.head_opt.step()
            self.head_sched.step()
            loss_sum, n_tok = (self._global_sum(sum(d[i] for d in depth_stats)) for i in range(2))
            metrics["mtp/loss"] = loss_sum / max(n_tok, 1.0)
            metrics["mtp/num_tokens"] = n_tok
            for d, (_loss, n, agree) in enumerate(depth_stats, start=1):
                metrics[f"mtp/top1_agreement_pos_{d}"] = self._global_sum(agree) / max(self._global_sum(n), 1.0)
        self.step += 1
        metrics["policy/step"] = float(self.step)
        return metrics

    # ------------------------------------------------------------------ weights
    def _gather_tp(self) -> list[dict[str, torch.Tensor]]:
        local = {n: p.detach().cpu() for n, p in self.model.named_parameters()}
        if self.cfg.tp == 1:
            return [local]
        shards: list[dict[str, torch.Tensor]] = [dict() for _ in range(self.cfg.tp)]
        for n, t in local.items():
            parts = [torch.empty_like(t) for _ in range(self.cfg.tp)]
            dist.all_gather(parts, t.contiguous(), group=self.tp_group)
            for r in range(self.cfg.tp):
                shards[r][n] = parts[r]
        return shards

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full HF-named weights (main + MTP) on CPU."""
        return megatron_to_hf(self._gather_tp(), self.args, self.mtp_layers)

    def _rng_state(self) -> dict:
        from megatron.core import tensor_parallel

        return {"torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}

    def save_checkpoint(self, ckpt_dir: str) -> None:
        state = {
            "step": self.step,
            "model": {n: p.detach().clone() for n, p in self.model.named_parameters()},
            "policy_opt": self.policy_opt.state_dict(), "policy_sched": self.policy_sched.state_dict(),
            "head_opt": self.head_opt.state_dict() if self.head_opt else None,
            "head_sched": self.head_sched.state_dict() if self.head_sched else None,
            "rng": self._rng_state(), "cfg": self.cfg.to_dict(),
        }
        ckpt.save_train_state(ckpt_dir, self.rank, state)
        hf = self.export_weights()
        if self.rank == 0:
            ckpt.export_hf(Path(ckpt_dir) / "hf", hf, self.hf_path)
            if self.mtp_layers > 0:
                ckpt.export_draft_head(Path(ckpt_dir) / "draft_head", hf, self.hf_path)
        if dist.get_world_size() > 1:
            dist.barrier()

    def load_checkpoint(self, ckpt_dir: str) -> None:
        from megatron.core import tensor_parallel

        state = ckpt.load_train_state(ckpt_dir, self.rank)
        load_into_model(self.model, state["model"])
        self.policy_opt.load_state_dict(state["policy_opt"])
        self.policy_sched.load_state_dict(state["policy_sched"])
        if self.head_opt is not None:
            if state["head_opt"] is None:
                raise ValueError(f"checkpoint {ckpt_dir!r} has no MTP head optimizer state but this worker trains one")
            self.head_opt.load_state_dict(state["head_opt"])
            self.head_sched.load_state_dict(state["head_sched"])
        torch.set_rng_state(state["rng"]["torch"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng"]["tracker"])
        self.step = int(state["step"])

    def shutdown(self) -> None:
        from .megatron.parallel_state import destroy_distributed

        if self.capture:
            self.capture.remove()
        destroy_distributed()
