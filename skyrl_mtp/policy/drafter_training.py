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
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from skyrl_mtp.mtp.draft_head import DraftLossSpec, DraftResult, draft_normaliser, output_weight
from skyrl_mtp.policy.config import PolicyWorkerConfig
from skyrl_mtp.policy.megatron.optimizers import TorchSideOptimizer, lr_scheduler


class ExternalDrafterTraining:
    """What every kind shares: the capture, the optimizer side and schedule, the sync stream, checkpoint weights.
    A kind says how its drafter starts (``initial``), which layers it reads, its loss and how it is exported."""

    def __init__(self, model, hf_path: str, cfg: PolicyWorkerConfig, device: torch.device, dp_group):
        from skyrl_mtp.mtp.layer_capture import LayerHiddenCapture

        target = json.loads((Path(hf_path) / "config.json").read_text())
        self.drafter, self.config = self.initial(target, cfg)
        self.drafter.to(device)
        self.capture = LayerHiddenCapture(model, self.aux_layer_ids())
        self.side = TorchSideOptimizer(list(self.drafter.parameters()), lr=cfg.head_lr,
                                       weight_decay=cfg.head_weight_decay, betas=cfg.head_betas, eps=cfg.head_eps,
                                       grad_clip=cfg.head_grad_clip, dp_group=dp_group, tp_group=None,
                                       name="drafter")
        self.sched = lr_scheduler(self.side.torch_optimizer, schedule=cfg.head_lr_schedule,
                                  warmup_steps=cfg.head_lr_warmup_steps, decay_steps=cfg.lr_decay_steps)
        self.cfg = cfg

    @classmethod
    def initial(cls, target: dict, cfg: PolicyWorkerConfig):
        """(drafter in fp32, its config): the export at ``cfg.drafter_init`` or a fresh one from ``cfg.seed``."""
        raise NotImplementedError

    @staticmethod
    def export_drafter(drafter, config, out_dir: str | Path) -> None:
        raise NotImplementedError

    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target layers it reads, in vLLM's aux numbering (0 = embedding, L = after decoder layer L-1)."""
        raise NotImplementedError

    def loss(self, model, logits: torch.Tensor, mb: dict, spec: DraftLossSpec, vocab_size: int) -> DraftResult:
        raise NotImplementedError

    def normaliser(self, loss_mask: torch.Tensor, segment_ids, input_ids: torch.Tensor, spec: DraftLossSpec) -> float:
        """The draft positions of a whole batch the loss is a mean over (as the MTP head's by default)."""
        return draft_normaliser(loss_mask, segment_ids, input_ids, spec)

    @staticmethod
    def target_embedding(model, mb: dict):
        def embed(ids: torch.Tensor) -> torch.Tensor:   # the target's (vocab-parallel) embedding, [B, S, H]
            return model.embedding(input_ids=ids, position_ids=mb["position_ids"]).transpose(0, 1)
        return embed

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, CPU tensor): the weight sync's "draft" part (never the target's shared tensors)."""
        for name, t in self.drafter.state_dict().items():
            yield name, t.detach().cpu()

    def export(self, out_dir: str | Path) -> None:
        self.export_drafter(self.drafter, self.config, out_dir)

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.iter_weights()}

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        self.drafter.load_state_dict(state, strict=True)

    def remove(self) -> None:
        self.capture.remove()


def _check_fits(loaded, want, init_path) -> None:
    if loaded != want:
        diff = {k: (getattr(loaded, k), getattr(want, k)) for k in want.__dataclass_fields__
                if getattr(loaded, k) != getattr(want, k)}
        raise ValueError(f"the drafter at {str(init_path)!r} does not fit this run: (its value, the run's) = {diff}")


class Eagle3Training(ExternalDrafterTraining):
    """An EAGLE-3 drafter (drafters/eagle3.py), trained on the MTP head's depth-d positions (mtp/eagle3_loss.py)."""

    @classmethod
    def initial(cls, target: dict, cfg: PolicyWorkerConfig):
        from skyrl_mtp.drafters.eagle3_export import initial_eagle3

        return initial_eagle3(target, cfg.drafter_layer_ids, cfg.seed, cfg.drafter_init)

    @staticmethod
    def export_drafter(drafter, config, out_dir: str | Path) -> None:
        from skyrl_mtp.drafters.eagle3_export import export_eagle3

        export_eagle3(drafter, config, out_dir)

    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.config.aux_layer_ids

    def loss(self, model, logits: torch.Tensor, mb: dict, spec: DraftLossSpec, vocab_size: int) -> DraftResult:
        from skyrl_mtp.mtp.draft_head import _tp_info
        from skyrl_mtp.mtp.eagle3_loss import compute_eagle3_loss

        self.drafter.train()
        return compute_eagle3_loss(self.drafter, self.capture.take(), logits, mb, spec,
                                   self.target_embedding(model, mb), output_weight(model), vocab_size, tp=_tp_info())


class DFlashTraining(ExternalDrafterTraining):
    """A DFlash drafter (drafters/dflash.py), trained on blocks anchored in the responses (mtp/dflash_loss.py)."""

    @classmethod
    def initial(cls, target: dict, cfg: PolicyWorkerConfig):
        from skyrl_mtp.drafters.dflash import DFlashConfig, DFlashDrafter

        ids = None if cfg.drafter_layer_ids is None else tuple(i - 1 for i in cfg.drafter_layer_ids)
        mask, loaded = cfg.drafter_mask_token_id, None
        if cfg.drafter_init is not None:   # its layers and mask token unless the run names others
            from skyrl_mtp.drafters.dflash_export import load_dflash

            drafter, loaded = load_dflash(cfg.drafter_init, int(target["num_hidden_layers"]))
            ids = loaded.target_layer_ids if ids is None else ids
            mask = loaded.mask_token_id if mask is None else mask
        want = DFlashConfig.from_target(target, ids, num_layers=cfg.drafter_num_layers,
                                        block_size=cfg.drafter_block_size, mask_token_id=mask)
        if loaded is None:
            return DFlashDrafter(want, torch.Generator().manual_seed(cfg.seed)), want
        _check_fits(loaded, want, cfg.drafter_init)
        return drafter.float(), want

    @staticmethod
    def export_drafter(drafter, config, out_dir: str | Path) -> None:
        from skyrl_mtp.drafters.dflash_export import export_dflash

        export_dflash(drafter, config, out_dir)

    def aux_layer_ids(self) -> tuple[int, ...]:
        return tuple(i + 1 for i in self.config.target_layer_ids)   # DFlash's ids are 0-based "after layer L"

    def normaliser(self, loss_mask: torch.Tensor, segment_ids, input_ids: torch.Tensor, spec: DraftLossSpec) -> float:
        from skyrl_mtp.mtp.dflash_loss import dflash_normaliser

        return dflash_normaliser(loss_mask, segment_ids, input_ids, spec, block_size=self.config.block_size,
                                 max_anchors=self.cfg.drafter_anchors)

    def loss(self, model, logits: torch.Tensor, mb: dict, spec: DraftLossSpec, vocab_size: int) -> DraftResult:
        from skyrl_mtp.mtp.dflash_loss import compute_dflash_loss
        from skyrl_mtp.mtp.draft_head import _tp_info

        self.drafter.train()
        return compute_dflash_loss(self.drafter, self.capture.take(), logits, mb, spec,
                                   self.target_embedding(model, mb), output_weight(model), vocab_size,
                                   max_anchors=self.cfg.drafter_anchors, tp=_tp_info())


KINDS: dict[str, type[ExternalDrafterTraining]] = {"eagle3": Eagle3Training, "dflash": DFlashTraining}


def build_drafter_training(model, hf_path: str, cfg: PolicyWorkerConfig, device: torch.device, dp_group):
    """The external drafter of ``cfg.drafter_kind``, or None for "mtp" (the model's own head)."""
    kind = KINDS.get(cfg.drafter_kind)
    return None if kind is None else kind(model, hf_path, cfg, device, dp_group)


def write_initial_export(cfg: PolicyWorkerConfig, target_dir: str | Path, out_dir: str | Path) -> Path:
    """The drafter a run's workers start from (``initial``), exported for the engines into ``out_dir`` (written
    aside, then renamed into place; an existing export is kept: from the same seed it is the same drafter)."""
    out = Path(out_dir)
    if (out / "model.safetensors").is_file():
        return out
    kind = KINDS[cfg.drafter_kind]
    drafter, config = kind.initial(json.loads((Path(target_dir) / "config.json").read_text()), cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        kind.export_drafter(drafter, config, tmp)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
