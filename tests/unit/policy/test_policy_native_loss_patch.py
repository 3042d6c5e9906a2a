"""The native-MTP-loss patch recognises both megatron-core layouts and fails loudly on any other."""

import types

import pytest
import torch

from skyrl_mtp.mtp.native_loss_patch import NativeMTPLossPatchError, _no_mtp_loss, detect_layout


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


def test_process_mtp_loss_replacement_strips_mtp_chunks():
    def process_mtp_loss(hidden_states, labels, loss_mask, output_layer, output_weight, runtime_gather_output,
                         is_training, compute_language_model_loss, config, cp_group=None):
        raise AssertionError

    assert detect_layout(types.SimpleNamespace(process_mtp_loss=process_mtp_loss)) == "process_mtp_loss"
    h = torch.arange(12.0).reshape(6, 1, 2)
    out = _no_mtp_loss(h, None, None, None, None, None, True, None, types.SimpleNamespace(mtp_num_layers=2))
    assert torch.equal(out, h[:2])
