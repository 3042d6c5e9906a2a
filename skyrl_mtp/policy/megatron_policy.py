"""One rank of the Megatron policy: forward/logprobs, decoupled policy + MTP-head training step,
weight export and checkpoints. ``PolicyWorker`` (worker.py) is this class as a Ray actor."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from skyrl_mtp.models.families.base import rules_for_expert_rank
from skyrl_mtp.policy.batch_layout import REQUIRED_TRAIN_KEYS, micro_batches, prepare, validate_batch
from skyrl_mtp.policy.config import PolicyWorkerConfig
from skyrl_mtp.policy.megatron import checkpoint as ckpt
from skyrl_mtp.policy.megatron.device import rank_device
from skyrl_mtp.policy.megatron.hf_bridge import load_hf_weights, load_into_model, mapped_tensors  # noqa: F401
from skyrl_mtp.policy.megatron.model_builder import (
    ModelBuildError,
    build_gpt_model,
    model_args_from_checkpoint,
    resolve_mtp_layers,
)
from skyrl_mtp.policy.megatron.optimizers import HEAD_PREFIX, TorchSideOptimizer, lr_scheduler, split_params
from skyrl_mtp.policy.megatron.parallel_state import init_distributed
from skyrl_mtp.policy.megatron.pipeline_stages import EMBEDDING, single_stage, stage_layout, stage_rules
from skyrl_mtp.policy.megatron.sharded_loading import LazyHFCheckpoint, check_checkpoint, load_tp_shard_into
from skyrl_mtp.policy.megatron.weight_export import StageBroadcast, export_layout, export_plan, iter_export
from skyrl_mtp.policy.pipelined_steps import PipelinedSteps, token_logprobs

POLICY_LOSSES = tuple(REQUIRED_TRAIN_KEYS)  # "dapo" (RL), "sft" (warm start)
WEIGHT_STREAMS = ("main", "draft")  # iter_hf_weights: the target model's tensors / the MTP head's
# Train-step metrics that time the step rather than describe its arithmetic; every other metric is a
# function of weights, batch and config alone, so two runs of the same step agree on it exactly.
WALL_CLOCK_METRICS = frozenset({"mtp/train_seconds"})


def reproducible_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k not in WALL_CLOCK_METRICS}


def _sequences_with_tokens(loss_mask: torch.Tensor) -> float:
    return float((loss_mask.float().sum(dim=1) > 0).sum())


class MegatronPolicy(PipelinedSteps):
    def __init__(self, cfg: PolicyWorkerConfig, hf_path: str, rank: int, world_size: int,
                 master_addr: str, master_port: int, listen_socket: socket.socket | None = None):
        if cfg.tp * cfg.pp * cfg.dp != world_size:
            raise ValueError(f"PolicyWorkerConfig tp*pp*dp = {cfg.tp}*{cfg.pp}*{cfg.dp} must equal "
                             f"world_size={world_size}")
        self.cfg, self.hf_path, self.rank = cfg, str(hf_path), rank
        self.args = model_args_from_checkpoint(hf_path)  # the family's arguments (self.args.family)
        if cfg.mtp_enabled and self.args.num_nextn_predict_layers == 0:
            raise ModelBuildError(
                f"mtp_enabled=True but the checkpoint {hf_path!r} has num_nextn_predict_layers=0 (no MTP layers); "
                "set mtp_enabled=False or use a checkpoint with an MTP head")
        self.mtp_layers = resolve_mtp_layers(self.args, cfg.mtp_num_layers, cfg.mtp_enabled)
        self.args.family.check_parallel(self.args, tp=cfg.tp, ep=cfg.ep, pp=cfg.pp)
        # the layers (megatron.layer_impl), checked on this node: one choice, for the model and for the names its
        # weights map to (only Transformer Engine's spec renames them)
        from skyrl_mtp.models.families.megatron_common import check_layer_impl

        self.device = rank_device()  # the one seam: this rank's device and collective backend
        check_layer_impl(cfg.layer_impl, self.device.device)
        self.transformer_engine = cfg.layer_impl == "transformer_engine"
        self.sdpa = cfg.layer_impl == "sdpa"
        # headers only, before the expensive distributed/model setup: a mismatch fails fast
        hf = LazyHFCheckpoint(hf_path)
        self.global_rules = check_checkpoint(hf, self.args, self.mtp_layers,   # experts by global index
                                             transformer_engine=self.transformer_engine)
        self._hf_shapes = {n: hf.shape(n) for r in self.global_rules.values() for n in r.hf_names}
        self._packed_experts = hf.packed   # the export writes experts back in the checkpoint's layout
        from skyrl_mtp.mtp.native_loss_patch import disable_native_mtp_loss

        init_distributed(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
                         tp=cfg.tp, pp=cfg.pp, seed=cfg.seed, device=self.device, listen_socket=listen_socket,
                         ep=cfg.ep)
        from megatron.core import parallel_state as ps

        disable_native_mtp_loss()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.expert_dp_group = ps.get_expert_data_parallel_group()
        self.weight_rules = rules_for_expert_rank(self.global_rules, ps.get_expert_model_parallel_rank(), cfg.ep)
        self.export_items = export_plan(self.global_rules, cfg.ep)
        self.pp_group = ps.get_pipeline_model_parallel_group() if cfg.pp > 1 else None
        self.pp_rank = ps.get_pipeline_model_parallel_rank() if cfg.pp > 1 else 0
        self.model = self._build_model()
        has_mtp = getattr(self.model, "mtp", None) is not None   # on the last stage only under PP
        self.layout = (stage_layout(self.model.config, self.pp_rank, cfg.pp, has_mtp) if cfg.pp > 1
                       else single_stage(self.args.num_layers, has_mtp))
        if cfg.pp > 1:
            from skyrl_mtp.policy.megatron import pipeline_schedule

            pipeline_schedule.configure(self.model)
        # each rank reads only its stage's parameters, its TP chunks of them (lazily), then moves to its device
        load_tp_shard_into(self.model, hf, stage_rules(self.weight_rules, self.layout), tp_rank=self.tp_rank,
                           tp_size=cfg.tp)
        del hf
        self.model.to(self.device.device)
        self._param_dtype = next(self.model.parameters()).dtype
        policy, head = split_params(self.model)
        if self.layout.embedding_is_copy:   # the MTP block's copy follows the first stage's (_refresh_embedding_copy)
            policy = [(n, p) for n, p in policy if n != EMBEDDING]
            self.model.embedding.word_embeddings.weight.requires_grad_(False)
        self.policy_params = [p for _, p in policy]
        self.head_params = [p for _, p in head]
        self.policy_side, self.head_side = self._build_sides()
        from skyrl_mtp.policy.megatron.router_stats import RouterStats

        self.router_stats = RouterStats(self.model)  # inactive (no hooks) on a dense model
        self.policy_opt = self.policy_side.torch_optimizer
        self.policy_sched = lr_scheduler(self.policy_opt, schedule=cfg.lr_schedule, warmup_steps=cfg.lr_warmup_steps,
                                         decay_steps=cfg.lr_decay_steps)
        self.head_opt = self.head_sched = None
        self.capture = None
        if self.head_side is not None:   # the stage with the MTP block (the last one under PP)
            from skyrl_mtp.mtp.capture import MTPInputCapture

            self.head_opt = self.head_side.torch_optimizer
            self.head_sched = lr_scheduler(self.head_opt, schedule=cfg.head_lr_schedule,
                                           warmup_steps=cfg.head_lr_warmup_steps, decay_steps=cfg.lr_decay_steps)
            self.capture = MTPInputCapture(self.model)
        from skyrl_mtp.policy.drafter_training import build_drafter_training

        self.drafter = build_drafter_training(self.model, self.hf_path, cfg, self.device.device, self.dp_group)
        if self.drafter is not None:   # an external drafter takes the MTP head's place: optimizer, schedule, capture
            self.head_side, self.head_sched, self.capture = self.drafter.side, self.drafter.sched, self.drafter.capture
            self.head_opt = self.head_side.torch_optimizer
        self.step = 0

    def _build_model(self):
        """This rank's stage of the model. Under PP, megatron-core ties the last stage's embedding copy to the
        first stage's at construction (an all-reduce of ``weight.data.cuda()``: the CPU shim's scope on CPU)
        and, with MTP there, flags the last stage's (untied) output layer as that shared weight, which would
        leave it out of Megatron's grad norm: the flags are cleared (the copy is refreshed by this class)."""
        from contextlib import nullcontext

        from skyrl_mtp.policy.megatron.cpu_shim import cuda_calls_on_cpu

        cfg = self.cfg
        scope = cuda_calls_on_cpu() if cfg.pp > 1 and not self.device.is_cuda else nullcontext()
        with scope:
            model = build_gpt_model(self.args, mtp_num_layers=self.mtp_layers, tp=cfg.tp, ep=cfg.ep, dtype=cfg.dtype,
                                    moe_dispatcher=self.device.moe_token_dispatcher,
                                    moe_aux_loss_coeff=cfg.moe_aux_loss_coeff, recompute=cfg.recompute_activations,
                                    transformer_engine=self.transformer_engine, pp=cfg.pp, pp_rank=self.pp_rank,
                                    sdpa=self.sdpa, fused_swiglu=cfg.fused_swiglu and self.device.is_cuda)
        out = getattr(model, "output_layer", None)
        if cfg.pp > 1 and out is not None and not self.args.tie_word_embeddings:
            for flag in ("shared", "shared_embedding"):
                if getattr(out.weight, flag, False):
                    setattr(out.weight, flag, False)
        return model

    def _build_sides(self):
        """(policy side, head side or None): Megatron DDP + distributed optimizer on GPU, torch AdamW on
        CPU (``RankDevice.megatron_optimizer`` decides); each side clips over its own params only."""
        cfg = self.cfg
        pkw = dict(lr=cfg.policy_lr, weight_decay=cfg.weight_decay, betas=cfg.betas, eps=cfg.eps,
                   grad_clip=cfg.policy_grad_clip)
        hkw = dict(lr=cfg.head_lr, weight_decay=cfg.head_weight_decay, betas=cfg.head_betas, eps=cfg.head_eps,
                   grad_clip=cfg.head_grad_clip)
        head_params = self.head_params if self.mtp_layers > 0 else []   # [] off the MTP stage
        if self.device.megatron_optimizer:
            from skyrl_mtp.policy.megatron.distributed_optimizer import build_megatron_side_optimizers

            return build_megatron_side_optimizers(self.model, self.policy_params, head_params, policy_kw=pkw,
                                                  head_kw=hkw, fused_adam=cfg.fused_adam)
        groups = dict(dp_group=self.dp_group, tp_group=self.tp_group, ep_group=self.ep_group,
                      expert_dp_group=self.expert_dp_group)
        head = TorchSideOptimizer(head_params, **hkw, **groups, name="head") if head_params else None
        # the policy's grad norm is the whole model's: summed over the pipeline stages too (the head is on one)
        return TorchSideOptimizer(self.policy_params, **pkw, **groups, pp_group=self.pp_group), head

    # ------------------------------------------------------------------ colocation
    def release_device_memory(self) -> list[str]:
        """Before colocated engines wake: grads and optimizer state to host memory if the memory plan said so
        (``offload_while_engines_awake``), then the allocator's cache back to the driver (policy/megatron/device.py)."""
        from skyrl_mtp.policy.megatron.device import hand_over_to_engines

        sides = [s for s in (self.policy_side, self.head_side) if s is not None]
        return hand_over_to_engines(self.device, sides, offload=self.cfg.offload_while_engines_awake)

    def reclaim_device_memory(self) -> list[str]:
        """After the colocated engines slept: what ``release_device_memory`` moved out comes back."""
        from skyrl_mtp.policy.megatron.device import take_back_from_engines

        sides = [s for s in (self.policy_side, self.head_side) if s is not None]
        return take_back_from_engines(self.device, sides, offload=self.cfg.offload_while_engines_awake)

    def _on_device(self, batch: dict) -> dict:
        dev = self.device.device
        return {k: (v.to(dev, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    # ------------------------------------------------------------------ forward
    def _forward(self, mb: dict) -> torch.Tensor:
        return self.model(mb["input_ids"], mb["position_ids"], mb["megatron_mask"])  # [B, S, V_local]

    def _check_packing(self, batch: dict) -> None:
        if batch.get("segment_ids") is None:
            return
        from skyrl_mtp.policy.batch_layout import BatchError

        if not self.args.family.supports_packed_sequences:
            raise BatchError(f"batch['segment_ids'] (packed sequences) cannot be used with a {self.args.family.name} "
                             "model: its mixers do not respect segment boundaries; allowed: one sequence per row")
        if self.transformer_engine:
            raise BatchError("batch['segment_ids'] (packed sequences) cannot be used with Transformer Engine's "
                             "attention: it masks causally in the kernel and ignores a dense mask; allowed: one "
                             "sequence per row")

    @torch.no_grad()
    def compute_logprobs(self, batch: dict) -> torch.Tensor:
        validate_batch(batch, ("input_ids", "attention_mask"))
        self._check_packing(batch)
        batch = self._on_device(prepare(batch))
        self.model.eval()
        if self.cfg.pp > 1:
            return self._pipelined_logprobs(batch)
        out = []
        for mb in micro_batches(batch, self.cfg.micro_batch_size):
            out.append(token_logprobs(self._forward(mb), mb["input_ids"]))
            if self.capture:
                self.capture.clear()
        return torch.cat(out, 0).cpu()

    # ------------------------------------------------------------------ training
    def _global_sum(self, x: float) -> float:
        t = torch.tensor(float(x), dtype=torch.float64, device=self.device.device)  # NCCL needs it on the GPU
        if dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(t, group=self.dp_group)
        return float(t)

    def _policy_loss(self, name: str, kw: dict, mb: dict, lp: torch.Tensor, counts: dict):
        """(loss of this micro-batch scaled so the sum over micro-batches and DP ranks is the batch loss,
        loss-function metrics)."""
        if name == "sft":
            loss = -(lp * mb["loss_mask"].to(lp.dtype)).sum() / counts["tokens"]
            return loss, {}
        from skyrl_mtp.algorithms.off_policy import corrected_policy_loss

        # DAPO's loss; with an off-policy correction in `kw`, weighted by the engine's behaviour logprobs
        loss, metrics = corrected_policy_loss(lp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"],
                                              behaviour_logprobs=mb.get("behaviour_logprobs"),
                                              global_num_tokens=counts["tokens"], **kw)
        if kw.get("loss_reduction", "token_mean") != "token_mean":
            # per-sequence reductions average over the micro-batch's sequences: rescale to the global count
            loss = loss * (float(_sequences_with_tokens(mb["loss_mask"])) / counts["sequences"])
        return loss, metrics

    def train_step(self, batch: dict, policy_loss: str = "dapo", policy_loss_kwargs: dict | None = None,
                   train_head: bool = True, head_depths: int | None = None) -> dict[str, float]:
        """One optimizer step of the policy (``policy_loss``: "dapo" or "sft") and, if the model has MTP
        layers and ``train_head``, one step of the MTP head on the decoupled draft loss of the same forward.

        ``train_head=False`` leaves the head, its optimizer and its LR schedule untouched (e.g. a warm
        start of the policy that keeps the head untrained); the policy update is the same either way.
        ``head_depths`` trains this step's head on depths 1..head_depths only (at most the configured
        ``mtp_num_depths``, the default): the trainer's choice under adaptive speculation.
        """
        if policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss={policy_loss!r} is not supported; allowed: {POLICY_LOSSES}")
        kw = dict(policy_loss_kwargs or {})
        if policy_loss == "sft" and kw:
            raise ValueError(f"policy_loss='sft' takes no policy_loss_kwargs; got {sorted(kw)}")
        if not isinstance(train_head, bool):
            raise ValueError(f"train_head={train_head!r} is invalid: expected True or False")
        depths = self.cfg.mtp_num_depths if head_depths is None else head_depths
        if isinstance(depths, bool) or not isinstance(depths, int) or not 1 <= depths <= self.cfg.mtp_num_depths:
            raise ValueError(f"head_depths={head_depths!r} is invalid: expected None or an int in "
                             f"1..{self.cfg.mtp_num_depths} (trainer.mtp.train_depths)")
        validate_batch(batch, REQUIRED_TRAIN_KEYS[policy_loss])
        self._check_packing(batch)
        batch = self._on_device(prepare(batch))
        self.model.train()
        head_on = self.capture is not None and train_head
        counts = {"tokens": max(self._global_sum(batch["loss_mask"].float().sum()), 1.0),
                  "sequences": max(self._global_sum(_sequences_with_tokens(batch["loss_mask"])), 1.0)}
        spec, n_draft = None, 0.0
        if head_on:
            from skyrl_mtp.mtp.draft_head import DraftLossSpec, draft_normaliser

            spec = DraftLossSpec(self.cfg.mtp_loss_type, depths, self.cfg.mtp_loss_topk,
                                 self.cfg.mtp_loss_chunk_size, self.cfg.mtp_loss_position_fraction,
                                 self.cfg.mtp_loss_depth_decay, self.cfg.draft_runner)
            count = self.drafter.normaliser if self.drafter is not None else draft_normaliser
            n_draft = count(batch["loss_mask"], batch.get("segment_ids"), batch["input_ids"], spec)
            n_draft = max(self._global_sum(n_draft), 1.0)
            self.head_side.zero_grad()
        self.policy_side.zero_grad()
        self.router_stats.clear()
        if self.cfg.moe_aux_loss_coeff > 0:
            self._scale_aux_loss(batch)
        fn_metrics: dict[str, float] = {}
        depth_stats: list[list[float]] = []
        policy_loss_total = 0.0
        head_seconds = 0.0
        if self.cfg.pp > 1:
            acc = self._pipelined_losses(batch, policy_loss, kw, counts, spec, n_draft, head_on)
            fn_metrics, depth_stats, policy_loss_total, head_seconds = acc
        else:
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
                    # nothing else reads this micro-batch's logits: free them now, not when the next micro-batch
                    # (or, after the last, the optimizer step) rebinds the name ([tokens, vocab] in the model dtype)
                    del logits, lp
                    if self.capture is not None:
                        self.capture.clear()
                    continue
                from skyrl_mtp.mtp.draft_head import compute_draft_loss

                t_head = self.device.clock()
                if self.drafter is not None:
                    res = self.drafter.loss(self.model, logits, mb, spec, self.args.vocab_size)
                else:
                    res = compute_draft_loss(self.model, self.capture.take(), logits, mb, spec, self.args.vocab_size)
                del logits, lp
                if res.loss_sum.requires_grad:
                    (res.loss_sum * (self.cfg.mtp_loss_weight / n_draft)).backward()
                head_seconds += self.device.clock() - t_head
                depth_stats += [[0.0, 0.0, 0.0] for _ in range(len(res.per_depth) - len(depth_stats))]
                for acc, vals in zip(depth_stats, res.per_depth):
                    for i in range(3):
                        acc[i] += vals[i]
        metrics = {k: self._global_sum(v) / counts["tokens"] for k, v in fn_metrics.items()}
        self.policy_side.reduce_grads()
        metrics["policy/loss"] = self._global_sum(policy_loss_total)
        metrics["policy/lr"] = self.policy_sched.get_last_lr()[0]
        metrics["policy/grad_norm"] = self.policy_side.step()  # clip over the policy's params only, then step
        self.policy_sched.step()
        self._refresh_embedding_copy()
        if head_on:
            t_head = self.device.clock()
            self.head_side.reduce_grads()
            metrics["mtp/lr"] = self.head_sched.get_last_lr()[0]
            metrics["mtp/grad_norm"] = self.head_side.step()
            self.head_sched.step()
            # what training the head added to this update (its replay, loss, backward and optimizer step)
            metrics["mtp/train_seconds"] = head_seconds + self.device.clock() - t_head
            loss_sum, n_tok = (self._global_sum(sum(d[i] for d in depth_stats)) for i in range(2))
            metrics["mtp/loss"] = loss_sum / max(n_tok, 1.0)
            metrics["mtp/num_tokens"] = n_tok
            for d, (_loss, n, agree) in enumerate(depth_stats, start=1):
                metrics[f"mtp/top1_agreement_pos_{d}"] = self._global_sum(agree) / max(self._global_sum(n), 1.0)
        if self.router_stats.active:
            metrics.update(self.router_stats.metrics(self.dp_group))
        self.step += 1
        metrics["policy/step"] = float(self.step)
        if self.cfg.pp > 1:   # the losses live on the last stage, the grad norm is global: its view, everywhere
            metrics = self._from_last_stage(metrics)
        return metrics

    def _scale_aux_loss(self, batch: dict) -> None:
        """The routers' load-balancing loss is a mean over micro-batches and data-parallel ranks (the gradients
        are summed over both): megatron-core scales its gradient by ``MoEAuxLossAutoScaler``'s loss scale."""
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        n_micro = -(-batch["input_ids"].shape[0] // self.cfg.micro_batch_size)
        scale = 1.0 / (n_micro * dist.get_world_size(self.dp_group))
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale, device=self.device.device))

    # ------------------------------------------------------------------ weights
    def _items(self, which: str | None) -> list:
        if which is None:
            return self.export_items
        if which not in WEIGHT_STREAMS:
            raise ValueError(f"which={which!r} is invalid; allowed: {WEIGHT_STREAMS}")
        draft = which == "draft"
        return [i for i in self.export_items if i.local_name.startswith(HEAD_PREFIX) == draft]

    def _local_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's tensors of the weight rules, under its own (stage-local) names."""
        return mapped_tensors(self.model, stage_rules(self.weight_rules, self.layout))

    def _tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this rank's stage owns, under their global names (the stage's own differ under PP)."""
        local = self._local_tensors()
        return {g: local[n] for g in self.weight_rules
                if self.layout.owner(g) == self.pp_rank and (n := self.layout.local_name(g)) is not None}

    def _iter_hf(self, items: list):
        stages = None
        if self.cfg.pp > 1:
            stages = StageBroadcast(self.layout, self.pp_group, tuple(dist.get_process_group_ranks(self.pp_group)),
                                    self._hf_shapes, self._param_dtype, self.device.device)
        return iter_export(items, self._tensors(), tp_size=self.cfg.tp, tp_group=self.tp_group, ep_size=self.cfg.ep,
                           ep_group=self.ep_group, stages=stages)

    def iter_hf_weights(self, which: str) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full CPU tensor) pairs of the "main" model or the "draft" (MTP) head, in layer order,
        one Megatron parameter gathered over TP at a time (extra memory: one parameter's full tensors).

        A collective over the TP and EP groups: every rank must iterate it to the end together; every rank
        receives the full tensors (the consumer on rank 0 uses them, the others drop them)."""
        items = self._items(which)  # ``which`` is checked now, not at the first next()
        return self.drafter.iter_weights() if which == "draft" and self.drafter is not None else self._iter_hf(items)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full HF-named weights (main + MTP) on CPU (the whole model in memory: prefer ``iter_hf_weights``)."""
        return dict(self._iter_hf(self.export_items))

    def _export_hf_streaming(self, ckpt_dir: str) -> None:
        """The HF export of a checkpoint, written tensor by tensor from the TP-gathered stream (rank 0
        writes; every TP rank iterates); the draft-head export keeps only the (small) MTP tensors."""
        from skyrl_mtp.policy.megatron.hf_export import write_safetensors_stream

        draft: dict[str, torch.Tensor] = {}
        want_draft = self.cfg.export_draft_head and self.mtp_layers > 0
        head_names = {n for i in self._items("draft") for n in i.hf_names()}

        def stream():
            for name, t in self._iter_hf(self.export_items):
                if want_draft and name in head_names:
                    draft[name] = t
                yield name, t

        if self.rank == 0 and self.cfg.export_hf:
            out = ckpt.copy_hf_side_files(Path(ckpt_dir) / "hf", self.hf_path)
            layout = export_layout(self.export_items, self._tensors(), self._hf_shapes, self._param_dtype)
            write_safetensors_stream(out / "model.safetensors", layout, stream(), packed=self._packed_experts)
        else:
            for _ in stream():
                pass
        if self.rank == 0 and want_draft:
            ckpt.export_draft_head(Path(ckpt_dir) / "draft_head", draft, self.hf_path)

    def _rng_state(self) -> dict:
        from megatron.core import tensor_parallel

        return {"torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}

    def save_checkpoint(self, ckpt_dir: str) -> None:
        state = {
            "step": self.step,
            "model": {n: p.detach().cpu().clone() for n, p in self._local_tensors().items()},
            "policy_opt": self.policy_side.state_dict(), "policy_sched": self.policy_sched.state_dict(),
            "head_opt": self.head_side.state_dict() if self.head_side else None,
            "head_sched": self.head_sched.state_dict() if self.head_sched else None,
            "rng": self._rng_state(), "cfg": self.cfg.to_dict(),
            "drafter": self.drafter.weights() if self.drafter is not None else None,
        }
        ckpt.save_train_state(ckpt_dir, self.rank, state)
        if self.cfg.export_hf or (self.cfg.export_draft_head and self.mtp_layers > 0):
            self._export_hf_streaming(ckpt_dir)  # collective over TP ranks: every rank takes part
        if self.rank == 0 and self.cfg.export_draft_head and self.drafter is not None:
            self.drafter.export(Path(ckpt_dir) / "draft_head")
        if dist.get_world_size() > 1:
            dist.barrier()

    def load_checkpoint(self, ckpt_dir: str) -> None:
        from megatron.core import tensor_parallel

        state = ckpt.load_train_state(ckpt_dir, self.rank)
        load_into_model(self.model, state["model"])
        self.policy_side.load_state_dict(state["policy_opt"])
        self.policy_sched.load_state_dict(state["policy_sched"])
        if self.head_opt is not None:
            if state["head_opt"] is None:
                raise ValueError(f"checkpoint {ckpt_dir!r} has no MTP head optimizer state but this worker trains one")
            self.head_side.load_state_dict(state["head_opt"])
            self.head_sched.load_state_dict(state["head_sched"])
        if self.drafter is not None:
            if state.get("drafter") is None:
                raise ValueError(f"checkpoint {ckpt_dir!r} holds no {self.cfg.drafter_kind} drafter but this worker "
                                 "trains one")
            self.drafter.load_weights(state["drafter"])
        torch.set_rng_state(state["rng"]["torch"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng"]["tracker"])
        self.step = int(state["step"])

    def shutdown(self) -> None:
        from skyrl_mtp.policy.megatron.parallel_state import destroy_distributed

        if self.capture:
            self.capture.remove()
        self.router_stats.remove()
        destroy_distributed()
