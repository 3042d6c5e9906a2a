"""The GPU training path the Megatron way: DDP grad buffers (fp32 main grads) and the distributed optimizer
(fp32 master weights and Adam state sharded over data parallel), once for the policy and once, separately,
for the MTP head.

Megatron's DDP and optimizer take every parameter with ``requires_grad`` of the module they are given.
The head's parameters live inside the same GPTModel as the policy's, so each side is built while the
other side's parameters are temporarily frozen: the policy's buffer and optimizer never see a head
parameter (its grad-norm and clip are the policy's alone) and the head's never see a policy one.

``MegatronSideOptimizer`` offers what the policy worker calls on either path (zero_grad, reduce grads,
clip + step, LR, state dicts); ``TorchSideOptimizer`` (optimizers.py: AdamW + manual DP all-reduce) is
the CPU twin. Which one a rank gets is decided by ``policy/device.py``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch


class MegatronOptimizerError(RuntimeError):
    """megatron-core's DDP / distributed-optimizer API is not what this module was written against."""


@contextmanager
def _only_trainable(params_on: list[torch.nn.Parameter], params_off: list[torch.nn.Parameter]):
    saved = [(p, p.requires_grad) for p in params_on + params_off]
    try:
        for p in params_off:
            p.requires_grad_(False)
        for p in params_on:
            p.requires_grad_(True)
        yield
    finally:
        for p, r in saved:
            p.requires_grad_(r)


def _require(obj, name: str, where: str):
    if not hasattr(obj, name):
        raise MegatronOptimizerError(f"{where}.{name} is missing in this megatron-core version; "
                                     "skyrl_mtp/policy/megatron/distributed_optimizer.py must be updated")
    return getattr(obj, name)


def megatron_ddp(model: torch.nn.Module, module: torch.nn.Module, params: list[torch.nn.Parameter],
                 others: list[torch.nn.Parameter], *, distributed: bool = True):
    """Megatron DDP over ``module`` whose fp32 grad buffer holds exactly ``params`` (``others`` frozen
    while it is built). Every parameter then accumulates its grad into ``param.main_grad``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=distributed)
    with _only_trainable(params, others):
        ddp = DistributedDataParallel(model.config, ddp_cfg, module)
    for name in ("zero_grad_buffer", "finish_grad_sync", "buffers"):
        _require(ddp, name, "megatron DistributedDataParallel")
    return ddp


def ddp_buffer_params(ddp) -> set[torch.nn.Parameter]:
    """The parameters a Megatron DDP wrapper keeps grads for (its buffers' param_index_map keys)."""
    out = set()
    for buf in ddp.buffers:
        out.update(_require(buf, "param_index_map", "megatron _ParamAndGradBuffer").keys())
    return out


class MegatronSideOptimizer:
    """One side (policy or MTP head): a Megatron DDP wrapper over ``module`` restricted to ``params`` and a
    Megatron (distributed) optimizer over the same parameters."""

    def __init__(self, model: torch.nn.Module, module: torch.nn.Module, params: list[torch.nn.Parameter],
                 others: list[torch.nn.Parameter], *, lr: float, weight_decay: float, betas, eps: float,
                 grad_clip: float, distributed: bool = True):
        from megatron.core import optimizer as mopt

        for name in ("get_megatron_optimizer", "OptimizerConfig"):
            _require(mopt, name, "megatron.core.optimizer")
        cfg = model.config
        bf16, fp16 = bool(getattr(cfg, "bf16", False)), bool(getattr(cfg, "fp16", False))
        self.params = params
        with _only_trainable(params, others):
            self.ddp = megatron_ddp(model, module, params, others, distributed=distributed)
            opt_cfg = mopt.OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay,
                                           adam_beta1=float(betas[0]), adam_beta2=float(betas[1]), adam_eps=eps,
                                           clip_grad=grad_clip, bf16=bf16, fp16=fp16,
                                           params_dtype=next(iter(params)).dtype,
                                           use_distributed_optimizer=distributed)
            self.opt = mopt.get_megatron_optimizer(opt_cfg, [self.ddp])

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()

    def reduce_grads(self) -> None:
        """All-reduce (or reduce-scatter, distributed) the fp32 main grads over data parallel."""
        self.ddp.finish_grad_sync()

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer inside (its param_groups carry the LR): what an LR scheduler drives."""
        return _require(self.opt, "optimizer", "megatron optimizer")

    def step(self) -> float:
        """Clip (by ``clip_grad``, over this side's params only) and step; returns the pre-clip grad-norm."""
        ok, grad_norm, _zeros = self.opt.step()
        if not ok:
            raise FloatingPointError("Megatron optimizer skipped the step (inf/nan in the gradients)")
        return float(grad_norm) if grad_norm is not None else math.nan

    def state_dict(self) -> dict:
        """This DP rank's optimizer: param groups plus its shard of fp32 master weights and Adam moments
        (a checkpoint is resumed with the same TP x DP layout)."""
        get = _require(self.opt, "get_parameter_state_dp_reshardable", "megatron DistributedOptimizer")
        return {"opt": self.opt.state_dict(), "param_state": get()}

    def load_state_dict(self, sd: dict) -> None:
        self.opt.load_state_dict(sd["opt"])
        _require(self.opt, "load_parameter_state_from_dp_reshardable", "megatron DistributedOptimizer")(
            sd["param_state"])


def build_megatron_side_optimizers(model: torch.nn.Module, policy_params, head_params, *, policy_kw: dict,
                                   head_kw: dict | None, distributed: bool = True):
    """(policy side, head side or None). ``*_kw``: lr, weight_decay, betas, eps, grad_clip."""
    policy = MegatronSideOptimizer(model, model, policy_params, head_params, distributed=distributed, **policy_kw)
    head = None
    if head_params:
        head = MegatronSideOptimizer(model, model.mtp, head_params, policy_params, distributed=distributed,
                                     **head_kw)
    return policy, head
