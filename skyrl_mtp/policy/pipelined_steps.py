"""The pipeline-parallel half of a policy rank (``megatron.pp > 1``): the steps that go through megatron-core's
pipeline schedule and the exchanges between stages. ``MegatronPolicy`` mixes it in; with one stage none of it
runs and the policy keeps its own micro-batch loop.

- Logprobs and the train step's losses are computed on the last stage; every stage then returns the last
  stage's results (PolicyGroup reads rank 0, a first-stage rank).
- The train step's loss on the last stage is the policy loss plus the decoupled draft loss of the same forward
  (the draft loss's graph starts from detached inputs and reaches MTP parameters only).
- The last stage's copy of the embedding (Megatron builds it for the MTP block) is overwritten with the first
  stage's after every update.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from skyrl_mtp.policy.batch_layout import micro_batches


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



class PipelinedSteps:
    """Needs ``self.cfg``, ``self.model``, ``self.layout``, ``self.pp_group``, ``self.device``, ``self.capture``."""

    def _pipeline(self, batch: dict, last_stage_loss, *, forward_only: bool) -> None:
        from skyrl_mtp.policy.megatron.pipeline_schedule import run_pipeline

        run_pipeline(self.model, list(micro_batches(batch, self.cfg.micro_batch_size)), last_stage_loss,
                     forward_only=forward_only, on_cpu=not self.device.is_cuda)

    def _last_stage_rank(self) -> int:
        return dist.get_process_group_ranks(self.pp_group)[-1]

    def _from_last_stage(self, obj):
        """``obj`` as the last pipeline stage has it, on every stage (metrics are computed there)."""
        box = [obj]
        dist.broadcast_object_list(box, src=self._last_stage_rank(), group=self.pp_group)
        return box[0]

    def _refresh_embedding_copy(self) -> None:
        """The last stage's copy of the embedding (read by the MTP block) := the first stage's, just updated."""
        if self.cfg.pp == 1 or self.mtp_layers == 0 or not (self.layout.is_first or self.layout.is_last):
            return
        from megatron.core import parallel_state as ps

        first = dist.get_process_group_ranks(self.pp_group)[0]
        dist.broadcast(self.model.embedding.word_embeddings.weight.data, src=first, group=ps.get_embedding_group())

    def _pipelined_logprobs(self, batch: dict) -> torch.Tensor:
        out: list[torch.Tensor] = []

        def keep(mb, logits):
            out.append(token_logprobs(logits, mb["input_ids"]))
            if self.capture:
                self.capture.clear()

        self._pipeline(batch, keep, forward_only=True)
        lp = (torch.cat(out, 0) if self.layout.is_last
              else torch.empty(batch["input_ids"].shape, dtype=torch.float32, device=self.device.device))
        dist.broadcast(lp, src=self._last_stage_rank(), group=self.pp_group)
        return lp.cpu()

    def _pipelined_losses(self, batch: dict, policy_loss: str, kw: dict, counts: dict, spec, n_draft: float,
                          head_on: bool):
        """The micro-batches through the pipeline schedule; on the last stage each micro-batch's loss is the
        policy loss plus the decoupled draft loss (its graph reaches MTP parameters only, so one backward of the
        sum gives each side exactly its own gradients). Returns the train-step accumulators."""
        fn_metrics: dict[str, float] = {}
        depth_stats: list[list[float]] = []
        totals = {"policy_loss": 0.0, "head_seconds": 0.0}

        def last_stage_loss(mb, logits):
            lp = token_logprobs(logits, mb["input_ids"])
            loss, m = self._policy_loss(policy_loss, kw, mb, lp, counts)
            totals["policy_loss"] += float(loss.detach())
            weight = float(mb["loss_mask"].float().sum())
            for k, v in m.items():
                key = k if "/" in k else f"policy/{k}"
                fn_metrics[key] = fn_metrics.get(key, 0.0) + float(v) * weight
            if not head_on:
                if self.capture is not None:
                    self.capture.clear()
                return loss
            from skyrl_mtp.mtp.draft_head import compute_draft_loss

            t_head = self.device.clock()   # the replay and loss; their backward runs in the schedule's
            res = compute_draft_loss(self.model, self.capture.take(), logits, mb, spec, self.args.vocab_size)
            totals["head_seconds"] += self.device.clock() - t_head
            depth_stats.extend([0.0, 0.0, 0.0] for _ in range(len(res.per_depth) - len(depth_stats)))
            for acc, vals in zip(depth_stats, res.per_depth):
                for i in range(3):
                    acc[i] += vals[i]
            if res.loss_sum.requires_grad:
                return loss + res.loss_sum * (self.cfg.mtp_loss_weight / n_draft)
            return loss

        self._pipeline(batch, last_stage_loss, forward_only=False)
        return fn_metrics, depth_stats, totals["policy_loss"], totals["head_seconds"]

