"""Disable megatron-core's built-in MTP loss, which would back-propagate a hard-CE into the trunk.

megatron-core 0.16.x computes it inline in ``GPTModel._postprocess``; 0.19 moved it into
``process_mtp_loss`` (imported by name into ``megatron.core.models.gpt.gpt_model``). On both, the MTP block
runs in ``_postprocess`` only when its ``mtp_in_postprocess`` argument says so, so the patch wraps
``_postprocess`` to skip the block (the decoupled draft loss replays it from inputs captured at the
decoder); on 0.19 ``process_mtp_loss`` is also replaced by one that strips MTP chunks and attaches no
loss, should any other path reach it. Any other layout raises: update this module first.
"""

from __future__ import annotations

import functools
import inspect

import torch


class NativeMTPLossPatchError(RuntimeError):
    """The megatron-core code this patch replaces has moved or changed."""


_STATE: dict[str, object] = {}

_POSTPROCESS_PARAMS = ("self", "hidden_states", "input_ids", "position_ids", "labels", "rotary_pos_emb",
                       "rotary_pos_cos", "rotary_pos_sin", "mtp_in_postprocess")
_PROCESS_MTP_LOSS_PARAMS = ("hidden_states", "labels", "loss_mask", "output_layer", "config")


def _missing_params(fn, wanted: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(fn's parameter names, those of ``wanted`` it lacks); a missing fn has none."""
    params = list(inspect.signature(fn).parameters) if fn is not None else []
    return params, [p for p in wanted if p not in params]


def detect_layout(gpt_model_module) -> str:
    """'process_mtp_loss' (0.19 style) or 'inline_postprocess' (0.16 style); raises otherwise."""
    if hasattr(gpt_model_module, "process_mtp_loss"):
        params, missing = _missing_params(gpt_model_module.process_mtp_loss, _PROCESS_MTP_LOSS_PARAMS)
        if missing:
            raise NativeMTPLossPatchError(
                f"megatron.core.models.gpt.gpt_model.process_mtp_loss changed signature {params}: "
                f"missing {missing}; update skyrl_mtp/mtp/native_loss_patch.py")
        post = getattr(getattr(gpt_model_module, "GPTModel", None), "_postprocess", None)
        params, missing = _missing_params(post, _POSTPROCESS_PARAMS)
        if missing:
            raise NativeMTPLossPatchError(
                f"GPTModel._postprocess (parameters {params}) lacks {missing}: the patch skips the MTP block "
                "through mtp_in_postprocess; update skyrl_mtp/mtp/native_loss_patch.py")
        return "process_mtp_loss"
    cls = getattr(gpt_model_module, "GPTModel", None)
    post = getattr(cls, "_postprocess", None)
    if post is None:
        raise NativeMTPLossPatchError(
            "neither megatron.core.models.gpt.gpt_model.process_mtp_loss nor GPTModel._postprocess exists: "
            "the native MTP loss moved; update skyrl_mtp/mtp/native_loss_patch.py")
    _, missing = _missing_params(post, _POSTPROCESS_PARAMS)
    src = inspect.getsource(post)
    markers = ("mtp_labels", "MTPLossAutoScaler.apply", "self.config.mtp_num_layers")
    absent = [m for m in markers if m not in src]
    if missing or absent:
        raise NativeMTPLossPatchError(
            f"GPTModel._postprocess no longer has the inline MTP loss this patch expects "
            f"(missing parameters {missing}, missing code markers {absent}); update native_loss_patch.py")
    return "inline_postprocess"


def _no_mtp_loss(hidden_states, labels=None, loss_mask=None, output_layer=None, output_weight=None,
                 runtime_gather_output=None, is_training=None, compute_language_model_loss=None,
                 config=None, *args, **kwargs):
    return torch.chunk(hidden_states, 1 + config.mtp_num_layers, dim=0)[0]


def _wrap_postprocess(orig):
    @functools.wraps(orig)
    def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                     rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=None, **kwargs):
        # The MTP block is not run here: its output would only feed the loss this patch removes. The
        # draft loss replays it from inputs captured at the decoder (skyrl_mtp/mtp/capture.py).
        saved = self.config.mtp_num_layers
        self.config.mtp_num_layers = None
        try:
            return orig(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                        rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=False, **kwargs)
        finally:
            self.config.mtp_num_layers = saved

    _postprocess.__skyrl_mtp_patched__ = True
    return _postprocess


def disable_native_mtp_loss(gpt_model_module=None) -> str:
    """Apply the patch (idempotent). Returns the layout patched."""
    if gpt_model_module is None:
        from megatron.core.models.gpt import gpt_model as gpt_model_module
    key = id(gpt_model_module)
    if key in _STATE:
        return _STATE[key]
    layout = detect_layout(gpt_model_module)
    cls = gpt_model_module.GPTModel
    cls._postprocess = _wrap_postprocess(cls._postprocess)
    if layout == "process_mtp_loss":
        gpt_model_module.process_mtp_loss = _no_mtp_loss
    _STATE[key] = layout
    return layout
