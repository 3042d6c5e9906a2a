"""Training checkpoints (model, both optimizers + schedules, RNG, step) and HF / draft-only exports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file


def rank_file(ckpt_dir: str | Path, rank: int) -> Path:
    return Path(ckpt_dir) / f"train_state_rank{rank}.pt"


def save_train_state(ckpt_dir: str | Path, rank: int, state: dict) -> Path:
    p = rank_file(ckpt_dir, rank)
    p.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, p)
    return p


def load_train_state(ckpt_dir: str | Path, rank: int) -> dict:
    p = rank_file(ckpt_dir, rank)
    if not p.is_file():
        raise FileNotFoundError(f"no training state for rank {rank} in checkpoint {str(ckpt_dir)!r} (expected {p.name})")
    return torch.load(p, weights_only=False)


def copy_hf_side_files(out_dir: str | Path, src_hf_dir: str | Path) -> Path:
    """Config, tokenizer and other non-weight files of the source checkpoint, copied into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(src_hf_dir).iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin")) and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    return out


def export_hf(out_dir: str | Path, hf_weights: dict[str, torch.Tensor], src_hf_dir: str | Path) -> Path:
    """HF safetensors checkpoint (config + tokenizer files copied from the source checkpoint)."""
    out = copy_hf_side_files(out_dir, src_hf_dir)
    save_file({k: v.contiguous() for k, v in hf_weights.items()}, str(out / "model.safetensors"))
    return out


def export_draft_head(out_dir: str | Path, hf_weights: dict[str, torch.Tensor], src_hf_dir: str | Path) -> Path:
    """The MTP head alone (its family's MTP tensors, e.g. MiMo's ``model.mtp_layers.*``) plus config.json; it
    shares embedding/lm_head with the target."""
    from skyrl_mtp.models.families import family_for_checkpoint

    family = family_for_checkpoint(src_hf_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mtp = family.mtp_hf_names(hf_weights)
    head = {k: v.contiguous() for k, v in hf_weights.items() if k in mtp}
    if not head:
        raise ValueError(f"export_draft_head: the weights contain no MTP tensors of the {family.name} layout "
                         "(MTP disabled?)")
    save_file(head, str(out / "draft_head.safetensors"))
    cfg = json.loads((Path(src_hf_dir) / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
