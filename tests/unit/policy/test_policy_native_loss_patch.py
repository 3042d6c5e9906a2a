"""The native-MTP-loss patch recognises both megatron-core layouts, skips the MTP block on both, and fails
loudly on any other layout."""

import types

import pytest
import torch

from skyrl_mtp.mtp.native_loss_patch import (
    NativeMTPLossPatchError,
    _no_mtp_loss,
    detect_layout,
    disable_native_mtp_loss,
)


def test_installed_megatron_layout_is_recognised():
    from megatron.core.models.gpt import gpt_model

    assert detect_layout(gpt_model) in ("inline_postprocess", "process_mtp_loss")


def test_missing_target_raises_clearly():
    fake = types.SimpleNamespace(GPTModel=type("GPTModel", (), {}))
    with pytest.raises(NativeMTPLossPatchError, match="native MTP loss moved"):
        detect_layout(fake)


def test_postprocess_without_inline_loss_raises():
    class GPTModel:
        def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                         rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=None):
            return hidden_states

    with pytest.raises(NativeMTPLossPatchError, match="missing code markers"):
        detect_layout(types.SimpleNamespace(GPTModel=GPTModel))


def test_process_mtp_loss_signature_change_raises():
    def process_mtp_loss(hidden, lbl):
        return hidden

    with pytest.raises(NativeMTPLossPatchError, match="changed signature"):
        detect_layout(types.SimpleNamespace(process_mtp_loss=process_mtp_loss))


def _process_mtp_loss(hidden_states, labels, loss_mask, output_layer, output_weight, runtime_gather_output,
                      is_training, compute_language_model_loss, config, cp_group=None):
    raise AssertionError


class _GPTModel019:
    def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                     rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None):
        return hidden_states


def test_process_mtp_loss_layout_needs_the_postprocess_switch():
    """0.19 layout: the MTP block is skipped through _postprocess(mtp_in_postprocess=...); without it, refuse."""
    class NoSwitch:
        def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                         rotary_pos_cos, rotary_pos_sin):
            return hidden_states

    with pytest.raises(NativeMTPLossPatchError, match=r"lacks \['mtp_in_postprocess'\]"):
        detect_layout(types.SimpleNamespace(process_mtp_loss=_process_mtp_loss, GPTModel=NoSwitch))
    with pytest.raises(NativeMTPLossPatchError, match="lacks"):
        detect_layout(types.SimpleNamespace(process_mtp_loss=_process_mtp_loss))


def test_both_layouts_skip_the_mtp_block():
    """The patched _postprocess runs the original with mtp_in_postprocess=False and no MTP layers in the
    config (so neither the block nor the loss runs), then restores the config."""
    seen = []

    class GPTModel(_GPTModel019):
        config = types.SimpleNamespace(mtp_num_layers=1)

        def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                         rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None):
            seen.append((mtp_in_postprocess, self.config.mtp_num_layers, loss_mask))
            return hidden_states

    mod = types.SimpleNamespace(process_mtp_loss=_process_mtp_loss, GPTModel=GPTModel)
    assert disable_native_mtp_loss(mod) == "process_mtp_loss"
    assert mod.process_mtp_loss is _no_mtp_loss
    m = GPTModel()
    assert m._postprocess("h", None, None, None, None, None, None, mtp_in_postprocess=True, loss_mask="lm") == "h"
    assert seen == [(False, None, "lm")] and m.config.mtp_num_layers == 1


def test_process_mtp_loss_replacement_strips_mtp_chunks():
    mod = types.SimpleNamespace(process_mtp_loss=_process_mtp_loss, GPTModel=_GPTModel019)
    assert detect_layout(mod) == "process_mtp_loss"
    h = torch.arange(12.0).reshape(6, 1, 2)
    out = _no_mtp_loss(h, None, None, None, None, None, True, None, types.SimpleNamespace(mtp_num_layers=2))
    assert torch.equal(out, h[:2])
