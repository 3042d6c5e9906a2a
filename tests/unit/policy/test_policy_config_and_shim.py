"""Config validation names the field; the CPU shim verifies its targets; batch layout helpers."""

import pytest
import torch

from skyrl_mtp.policy.batch_layout import BatchError, prepare, segment_positions, validate_batch
from skyrl_mtp.policy.config import PolicyConfigError, PolicyWorkerConfig
from skyrl_mtp.policy.megatron import cpu_shim


@pytest.mark.parametrize("field,value,msg", [
    ("mtp_loss_type", "kl", "mtp_loss_type='kl'"), ("mtp_loss_topk", 0, "mtp_loss_topk=0"),
    ("tp", 0, "tp=0"), ("pp", 0, "pp=0"), ("dtype", "int8", "dtype='int8'"),
    ("head_grad_clip", 0.0, "head_grad_clip=0.0"), ("mtp_detach_trunk", False, "mtp_detach_trunk=False"),
    ("mtp_num_layers", -1, "mtp_num_layers=-1"),
])
def test_bad_config_field_is_named(field, value, msg):
    with pytest.raises(PolicyConfigError, match=msg):
        PolicyWorkerConfig(**{field: value})


def test_cpu_shim_rejects_changed_targets():
    with pytest.raises(cpu_shim.CpuShimError, match="missing"):
        cpu_shim._require_attr(object(), "_get_cuda_rng_state", "megatron.core.tensor_parallel.random")

    def changed(state):
        return state

    with pytest.raises(cpu_shim.CpuShimError, match="changed signature"):
        cpu_shim._require_params(changed, ("new_state", "device"), "megatron _set_cuda_rng_state")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is applied only without CUDA")
def test_cpu_shim_applies_and_tracker_forks_on_cpu():
    assert cpu_shim.apply_cpu_shim()
    from megatron.core.tensor_parallel import random as mrandom

    tr = mrandom.CudaRNGStatesTracker()
    tr.add("x", 123)
    before = torch.get_rng_state()
    with tr.fork("x"):
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(a, torch.rand(3, generator=torch.Generator().manual_seed(123)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the emulation is for CPU-only machines")
def test_megatron_optimizer_emulation_is_scoped():
    assert cpu_shim.apply_cpu_shim()
    x = torch.ones(2)
    with cpu_shim.megatron_optimizer_on_cpu():
        made = torch.tensor([0.0], dtype=torch.float, device="cuda")
        zeros = torch.zeros(1, dtype=torch.int, device=torch.device("cuda", 0))
        assert made.device.type == zeros.device.type == "cpu"
        assert x.cuda() is x
        assert (x.type(), x.bfloat16().type(), x.long().type()) == (
            "torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor", "torch.LongTensor")
        assert x.type(torch.float64).dtype == torch.float64         # the conversion form is untouched
    assert x.type() == "torch.FloatTensor"                          # nothing leaks out of the scope
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


def test_segment_positions_and_mask():
    seg = torch.tensor([[0, 0, 0, 1, 1, -1]])
    assert segment_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0]]
    b = prepare({"input_ids": torch.zeros(1, 6, dtype=torch.long), "segment_ids": seg})
    m = b["megatron_mask"][0, 0]
    assert m[3, 2] and not m[4, 3] and m[1, 2] and not m[2, 0]
    with pytest.raises(BatchError, match="loss_mask"):
        validate_batch({"input_ids": torch.zeros(2, 3), "loss_mask": torch.zeros(2, 4)}, ("input_ids",))


def test_rows_of_one_sequence_take_the_causal_path_without_a_dense_mask():
    from skyrl_mtp.policy.batch_layout import layout_bytes, packed_mask

    b, s = 16, 512
    ids = torch.zeros(b, s, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    plain = prepare(batch)
    assert plain["megatron_mask"] is None
    # the layout is the batch's own tensors plus position ids: 4 x [B, S] int64
    assert layout_bytes(plain) == 4 * b * s * 8 == 262144
    packed = prepare({**batch, "segment_ids": torch.zeros_like(ids)})
    assert packed["megatron_mask"].shape == (b, 1, s, s)
    assert layout_bytes(packed) == 5 * b * s * 8 + b * s * s == 4521984   # what every batch carried before
    # the dense mask of one segment per row is exactly the causal mask (True above the diagonal)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    assert torch.equal(packed_mask(torch.zeros(2, s, dtype=torch.long)), causal.expand(2, 1, s, s))


def test_megatrons_causal_softmax_without_a_mask_equals_the_dense_mask_bitwise():
    # the local attention's softmax (fused_softmax.py forward_torch_softmax) builds the causal mask itself when the
    # mask is None; on the CPU through the shim's get_default_causal_mask
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    from skyrl_mtp.policy.batch_layout import packed_mask

    assert cpu_shim.apply_cpu_shim()
    softmax = FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=False, attn_mask_type=AttnMaskType.causal,
                                    scaled_masked_softmax_fusion=False, mask_func=attention_mask_func,
                                    softmax_in_fp32=True, scale=None)
    scores = torch.randn(3, 4, 9, 9, generator=torch.Generator().manual_seed(0))
    dense = softmax(scores.clone(), packed_mask(torch.zeros(3, 9, dtype=torch.long)))
    causal = softmax(scores.clone(), None)
    assert torch.equal(dense, causal) and causal[0, 0, 0, 1] == 0
