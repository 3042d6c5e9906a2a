"""A policy worker's drafter when it is not the model's own MTP head (``PolicyWorkerConfig.drafter_kind``).

Such a drafter lives beside the Megatron model, not in it: it reads the target's hidden states, recorded during
the policy's own forward (mtp/layer_capture.py, detached), trains on the decoupled draft loss against the policy's
next-token distribution with an optimizer and LR schedule of its own (the head's settings), and is what the weight
sync's "draft" part and a checkpoint's draft-only export carry. The policy's update never sees it.

One class per kind, registered in ``KINDS``; "mtp" needs none (the MTP layers are part of the Megatron model).
The drafter is replicated on every tensor-parallel rank (it is small) and kept in fp32 whatever the policy's dtype.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from skyrl_mtp.mtp.draft_head import DraftLossSpec, DraftResult, output_weight
from skyrl_mtp.policy.config import PolicyWorkerConfig
from skyrl_mtp.policy.megatron.optimizers import TorchSideOptimizer, lr_scheduler


class Eagle3Training:
    """An EAGLE-3 drafter (drafters/eagle3.py) trained online on the policy's forward."""

    def __init__(self, model, hf_path: str, cfg: PolicyWorkerConfig, device: torch.device, dp_group):
        from skyrl_mtp.drafters.eagle3_export import initial_eagle3
        from skyrl_mtp.mtp.layer_capture import LayerHiddenCapture

        target = json.loads((Path(hf_path) / "config.json").read_text())
        self.drafter, self.config = initial_eagle3(target, cfg.drafter_layer_ids, cfg.seed, cfg.drafter_init)
        self.drafter.to(device)
        self.capture = LayerHiddenCapture(model, self.config.aux_layer_ids)
        self.side = TorchSideOptimizer(list(self.drafter.parameters()), lr=cfg.head_lr,
                                       weight_decay=cfg.head_weight_decay, betas=cfg.head_betas, eps=cfg.head_eps,
                                       grad_clip=cfg.head_grad_clip, dp_group=dp_group, tp_group=None,
                                       name="drafter")
        self.sched = lr_scheduler(self.side.torch_optimizer, schedule=cfg.head_lr_schedule,
                                  warmup_steps=cfg.head_lr_warmup_steps, decay_steps=cfg.lr_decay_steps)

    def loss(self, model, logits: torch.Tensor, mb: dict, spec: DraftLossSpec, vocab_size: int) -> DraftResult:
        """This micro-batch's draft loss (the capture's states of the forward that produced ``logits``)."""
        from skyrl_mtp.mtp.draft_head import _tp_info
        from skyrl_mtp.mtp.eagle3_loss import compute_eagle3_loss

        def embed(ids: torch.Tensor) -> torch.Tensor:   # the target's (vocab-parallel) embedding, [B, S, H]
            return model.embedding(input_ids=ids, position_ids=mb["position_ids"]).transpose(0, 1)

        self.drafter.train()
        return compute_eagle3_loss(self.drafter, self.capture.take(), logits, mb, spec, embed,
                                   output_weight(model), vocab_size, tp=_tp_info())

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, CPU tensor): the weight sync's "draft" part (never the target's shared tensors)."""
        for name, t in self.drafter.state_dict().items():
            yield name, t.detach().cpu()

    def export(self, out_dir: str | Path) -> None:
        from skyrl_mtp.drafters.eagle3_export import export_eagle3

        export_eagle3(self.drafter, self.config, out_dir)

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.iter_weights()}

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        self.drafter.load_state_dict(state, strict=True)

    def remove(self) -> None:
        self.capture.remove()


KINDS = {"eagle3": Eagle3Training}


def build_drafter_training(model, hf_path: str, cfg: PolicyWorkerConfig, device: torch.device, dp_group):
    """The external drafter of ``cfg.drafter_kind``, or None for "mtp" (the model's own head)."""
    kind = KINDS.get(cfg.drafter_kind)
    return None if kind is None else kind(model, hf_path, cfg, device, dp_group)
