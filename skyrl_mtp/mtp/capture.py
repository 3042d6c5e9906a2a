"""Record what the MTP block is fed during the policy forward, for a detached replay afterwards.

The MTP block's inputs are the trunk's attention mask and rotary embedding (the very tensors the
decoder receives), the trunk output and the token ids. Two forward pre-hooks record them:
- on ``model.decoder`` (with_kwargs=True): ``attention_mask``, ``rotary_pos_emb`` and the rest of
  the keyword arguments the MTP block is later called with;
- on the decoder's final layernorm: its input is the trunk hidden state BEFORE the final norm, which
  is what vLLM's MiMo drafter receives (Megatron itself passes the post-norm state).
Hooking the decoder rather than ``model.mtp`` lets the patched forward (native_loss_patch.py) skip
running the MTP block altogether: the block runs once per step, in the replay that trains it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# decoder keyword arguments the replay passes on to the MTP layer
REPLAY_KWARGS = ("attention_mask", "rotary_pos_emb")


class CaptureError(RuntimeError):
    """Nothing (or not everything) was captured during the forward."""


@dataclass
class CapturedMTPInputs:
    mtp_kwargs: dict
    prenorm_hidden: torch.Tensor  # [S, B, H], trunk output before the final layernorm


class MTPInputCapture:
    def __init__(self, model: torch.nn.Module):
        if getattr(model, "mtp", None) is None:
            raise CaptureError("model has no MTP block (model.mtp); build it with mtp_num_layers > 0")
        decoder = getattr(model, "decoder", None)
        norm = getattr(decoder, "final_layernorm", None)
        if norm is None:
            raise CaptureError("model.decoder.final_layernorm not found; cannot capture the pre-norm hidden state")
        self._kwargs: dict | None = None
        self._prenorm: torch.Tensor | None = None
        self._handles = [
            decoder.register_forward_pre_hook(self._on_decoder, with_kwargs=True),
            norm.register_forward_pre_hook(self._on_norm),
        ]

    def _on_decoder(self, module, args, kwargs):
        missing = [k for k in REPLAY_KWARGS if k not in kwargs]
        if missing:
            raise CaptureError(f"model.decoder was called without keyword arguments {missing} "
                               f"(got {sorted(kwargs)}); the MTP replay needs them")
        self._kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}

    def _on_norm(self, module, args):
        self._prenorm = args[0]

    def clear(self) -> None:
        self._kwargs, self._prenorm = None, None

    def take(self) -> CapturedMTPInputs:
        if self._kwargs is None or self._prenorm is None:
            raise CaptureError("the MTP block's inputs were not captured in the last forward")
        out = CapturedMTPInputs(self._kwargs, self._prenorm)
        self.clear()
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
