"""Fused AdamW where megatron-core falls back to torch's: `fuse_torch_adam` switches the torch AdamW it built to torch's
fused kernel (no fp32 temporary of every parameter), and that kernel's steps equal the foreach steps megatron-core's
AdamW took before (on the CPU, where torch's AdamW has a fused kernel too)."""

from __future__ import annotations

import copy

import pytest
import torch

from skyrl_mtp.policy.megatron.distributed_optimizer import MegatronOptimizerError, fuse_torch_adam


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in ((64, 32), (32,), (7, 5, 3))]


def _run(opt_params, opt, steps: int = 5):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in opt_params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_the_fused_step_equals_the_foreach_step():
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    a, b = _params(0), _params(0)
    foreach = torch.optim.AdamW(a, foreach=True, **kw)         # what megatron-core's fallback runs on GPUs
    fused = torch.optim.AdamW(b, **kw)                         # as megatron-core builds it: foreach left to torch
    assert fuse_torch_adam(fused)
    assert all(g["fused"] is True and g["foreach"] is False for g in fused.param_groups)
    _run(a, foreach)
    _run(b, fused)
    for pa, pb in zip(a, b):
        assert (pa - pb).abs().max() < 1e-6, (pa - pb).abs().max()
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(foreach.state[pa][key], fused.state[pb][key], rtol=1e-6, atol=1e-9), key
        assert float(foreach.state[pa]["step"]) == float(fused.state[pb]["step"]) == 5
    assert any((pa - q).abs().max() > 1e-3 for pa, q in zip(a, _params(0)))   # the steps moved the weights


def test_a_fused_optimizer_resumes_from_a_state_dict():
    kw = dict(lr=1e-2, weight_decay=0.1)
    a = _params(0)
    opt = torch.optim.AdamW(a, **kw)
    fuse_torch_adam(opt)
    _run(a, opt, steps=2)
    sd = copy.deepcopy(opt.state_dict())                     # (a state_dict shares the live tensors)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    again = torch.optim.AdamW(b, **kw)
    fuse_torch_adam(again)
    again.load_state_dict(sd)
    _run(a, opt, steps=2)
    _run(b, again, steps=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_what_it_leaves_alone_and_what_it_refuses():
    sgd = torch.optim.SGD(_params(0), lr=0.1)
    assert not fuse_torch_adam(sgd)                               # not an Adam: untouched
    assert "fused" not in sgd.param_groups[0] or not sgd.param_groups[0]["fused"]
    opt = torch.optim.AdamW(_params(0), lr=0.1)
    del opt.param_groups[0]["foreach"]                            # a torch whose groups moved their flags
    with pytest.raises(MegatronOptimizerError, match=r"param groups lack \['foreach'\]"):
        fuse_torch_adam(opt)


def test_megatrons_distributed_optimizer_steps_the_same_with_the_fused_kernel(tmp_path):
    import torch.multiprocessing as mp
    from megatron_adam_rank import run
    from mimo_fixture import mimo_config, write_mimo_checkpoint

    ckpt = write_mimo_checkpoint(tmp_path / "ckpt", mimo_config())
    out = tmp_path / "res.pt"
    mp.start_processes(run, args=(str(ckpt), str(out)), nprocs=1, join=True, start_method="spawn")
    res = torch.load(out, weights_only=False)
    foreach, fused = res[False], res[True]
    assert fused["side"] == "MegatronSideOptimizer" and fused["switched"] == [True, True]   # policy and head
    assert foreach["metrics"]["policy/grad_norm"] > 1 and foreach["metrics"]["mtp/grad_norm"] > 1
    for key in ("policy/grad_norm", "mtp/grad_norm", "policy/loss"):
        assert abs(foreach["metrics"][key] - fused["metrics"][key]) < 1e-5 * abs(foreach["metrics"][key]), key
    for name, w in foreach["weights"].items():
        assert (w - fused["weights"][name]).abs().max() < 1e-5, name


def test_a_torch_side_handed_to_colocated_engines_and_back_steps_as_if_it_never_left():
    """TorchSideOptimizer.offload_to_host frees the spent grads and moves Adam's moments to host memory (on a CPU rank
    a move in place), restore_to_device brings them back: the next steps equal those of a side that stayed."""
    from skyrl_mtp.policy.megatron.optimizers import TorchSideOptimizer

    def side(seed):
        p = torch.nn.Parameter(torch.randn(16, 8, generator=torch.Generator().manual_seed(seed)))
        return p, TorchSideOptimizer([p], lr=1e-2, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8, grad_clip=1.0,
                                     dp_group=None, tp_group=None, name="drafter")

    (a, sa), (b, sb) = side(0), side(0)
    for step in range(4):
        for p, s in ((a, sa), (b, sb)):
            s.zero_grad()
            (p * torch.arange(128.0).view(16, 8) * (step + 1)).pow(2).sum().backward()
            s.step()
        if step == 1:
            sb.offload_to_host()
            assert b.grad is None and all(v.device.type == "cpu" for v in sb.opt.state[b].values())
            sb.restore_to_device()
    assert torch.equal(a, b) and sb.name == "drafter"
