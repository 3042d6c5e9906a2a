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
