"""The GPU training path the Megatron way: DDP grad buffers (fp32 main grads) and the distributed optimizer
(fp32 master weights and Adam state sharded over data parallel), once for the policy and once, separately,
for the MTP head.

Megatron's DDP and optimizer take every parameter with ``requires_grad`` of the module they are given.
The head's parameters live inside the same GPTModel as the policy's, so each side is built while the
other side's parameters are temporarily frozen: the policy's buffer and optimizer never see a head
parameter (its grad-norm and clip are the policy's alone) and the head's never see a policy one.

Under expert parallelism megatron-core keeps routed experts' parameters (``allreduce=False``) in DDP buffers of
their own, summed over the ranks holding the same experts, and ``get_megatron_optimizer`` returns a chained
optimizer: one for the dense parameters and one for the experts' (its grad norm covers both, over the right
groups). A side then drives both, and its LR schedule drives their parameter groups through one view.

``MegatronSideOptimizer`` offers what the policy worker calls on either path (zero_grad, reduce grads,
clip + step, LR, state dicts); ``TorchSideOptimizer`` (optimizers.py: AdamW + manual DP all-reduce) is
the CPU twin. Which one a rank gets is decided by ``policy/megatron/device.py`` (which can also put a CPU rank on this
path: its parameters are then CPU tensors and every Megatron call runs under
``cpu_shim.megatron_optimizer_on_cpu``).

Gradients are summed over data parallel, not averaged: the policy worker already normalises each rank's loss
by the global token count (as ``TorchSideOptimizer``'s all-reduce sums), so the DDP wrapper is built with
``calculate_per_token_loss`` (Megatron's "no 1/DP pre-scaling") on a private copy of the model config.
Both sides use one parameter group with the side's weight decay on every parameter (like torch AdamW on the
CPU path): Megatron's default bias/norm ``wd_mult=0`` groups only take effect through Megatron's own LR/WD
scheduler, which this project does not use (a LambdaLR drives the LR).
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager, nullcontext

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
    _require(model.config, "calculate_per_token_loss", "megatron TransformerConfig")
    summed = copy.copy(model.config)  # the model's own config keeps its value (the MTP loss reads it)
    summed.calculate_per_token_loss = True  # DP-summed grads: the loss is already globally normalised
    with _only_trainable(params, others):
        ddp = DistributedDataParallel(summed, ddp_cfg, module)
    for name in ("zero_grad_buffer", "finish_grad_sync", "buffers"):
        _require(ddp, name, "megatron DistributedDataParallel")
    return ddp


def ddp_buffer_params(ddp) -> set[torch.nn.Parameter]:
    """The parameters a Megatron DDP wrapper keeps grads for (its dense and expert-parallel buffers'
    param_index_map keys)."""
    out = set()
    for buf in [*ddp.buffers, *_require(ddp, "expert_parallel_buffers", "megatron DistributedDataParallel")]:
        out.update(_require(buf, "param_index_map", "megatron _ParamAndGradBuffer").keys())
    return out


FUSED_ADAM_GROUP_KEYS = ("fused", "foreach", "differentiable", "capturable")


def fuse_torch_adam(opt: torch.optim.Optimizer) -> bool:
    """Switch a torch Adam / AdamW that megatron-core built to torch's fused kernel; returns whether it did.

    Without Transformer Engine or apex megatron-core falls back to ``torch.optim.AdamW`` with ``foreach`` left to
    torch (megatron/core/optimizer/__init__.py, ``USING_PYTORCH_OPTIMIZER``), and torch's foreach step allocates an
    fp32 temporary of every parameter of the group at once (torch/optim/adam.py ``_multi_tensor_adam``:
    ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)``) besides making several passes over the state.
    The fused step (``_fused_adam``: ``torch._fused_adamw_``) is the same update in one kernel per group, with no
    temporary. The group flags are what torch's constructor sets for ``fused=True``; TE's / apex's FusedAdam (fused
    already) are left alone."""
    if type(opt) not in (torch.optim.AdamW, torch.optim.Adam):
        return False
    for group in opt.param_groups:
        missing = [k for k in FUSED_ADAM_GROUP_KEYS if k not in group]
        if missing:
            raise MegatronOptimizerError(f"torch {type(opt).__name__}'s param groups lack {missing}: this torch "
                                         "moved its fused / foreach flags; update fuse_torch_adam")
        if group["differentiable"]:
            return False
    for group in opt.param_groups:
        group["foreach"], group["fused"] = False, True
    opt._step_supports_amp_scaling = True   # what Adam.__init__ sets with fused=True (GradScaler's contract)
    return True


def _device_scope(params: list[torch.nn.Parameter]):
    """The context every Megatron DDP / optimizer call of a side runs in: none on GPU, the CPU emulation
    (``cpu_shim.megatron_optimizer_on_cpu``) when the side's parameters are CPU tensors."""
    devices = {p.device.type for p in params}
    if devices == {"cuda"}:
        return nullcontext
    if devices == {"cpu"}:
        from skyrl_mtp.policy.megatron.cpu_shim import megatron_optimizer_on_cpu

        return megatron_optimizer_on_cpu
    raise MegatronOptimizerError(f"a side's parameters must all be on one device type, got {sorted(devices)}")


class MegatronSideOptimizer:
    """One side (policy or MTP head): a Megatron DDP wrapper over ``module`` restricted to ``params`` and a
    Megatron (distributed) optimizer over the same parameters."""

    def __init__(self, model: torch.nn.Module, module: torch.nn.Module, params: list[torch.nn.Parameter],
                 others: list[torch.nn.Parameter], *, lr: float, weight_decay: float, betas, eps: float,
                 grad_clip: float, distributed: bool = True, fused_adam: bool = True):
        from megatron.core import optimizer as mopt

        for name in ("get_megatron_optimizer", "OptimizerConfig"):
            _require(mopt, name, "megatron.core.optimizer")
        cfg = model.config
        bf16, fp16 = bool(getattr(cfg, "bf16", False)), bool(getattr(cfg, "fp16", False))
        self.params = params
        self.name = "head" if module is not model else "policy"
        self._offloaded = False
        self._scope = _device_scope(params)
        with self._scope(), _only_trainable(params, others):
            self.ddp = megatron_ddp(model, module, params, others, distributed=distributed)
            opt_cfg = mopt.OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay,
                                           adam_beta1=float(betas[0]), adam_beta2=float(betas[1]), adam_eps=eps,
                                           clip_grad=grad_clip, bf16=bf16, fp16=fp16,
                                           params_dtype=next(iter(params)).dtype,
                                           use_distributed_optimizer=distributed)
            # config_overrides={}: one group, the side's weight decay on every parameter (module docstring)
            self.opt = mopt.get_megatron_optimizer(opt_cfg, [self.ddp], config_overrides={})
        inner = _require(self.opt, "chained_optimizers", "megatron ChainedOptimizer")
        experts = any(not getattr(p, "allreduce", True) for p in params)
        if len(inner) != 1 + experts:
            raise MegatronOptimizerError(f"expected {1 + experts} Megatron optimizers for this side (dense params"
                                         f"{' and expert-parallel params' if experts else ''}), got {len(inner)}")
        # the DistributedOptimizers (FP32Optimizers when not distributed): dense, then expert-parallel
        self.inner = list(inner)
        # GPU ranks: torch's fused AdamW where megatron-core fell back to torch's (CPU ranks keep what they had)
        on_gpu = all(p.device.type == "cuda" for p in params)
        fused = [fuse_torch_adam(o.optimizer) for o in self.inner] if fused_adam and on_gpu else []
        self.torch_adam_fused = bool(fused) and all(fused)   # False: as megatron-core built it

    def zero_grad(self) -> None:
        with self._scope():
            self.ddp.zero_grad_buffer()
            self.opt.zero_grad()

    def offload_to_host(self) -> None:
        """Colocated engines awake: free the fp32 grad buffer (its contents are spent once the step is taken) and move
        the optimizer's fp32 master shard and Adam moments to host memory, through megatron-core's own RL API
        (DistributedDataParallel.offload_grad_buffers, MegatronOptimizer.offload_to_cpu)."""
        if self._offloaded:
            return
        offload = _require(self.ddp, "offload_grad_buffers", "megatron DistributedDataParallel")
        to_cpu = _require(self.opt, "offload_to_cpu", "megatron optimizer")
        offload(synchronize=True, empty_cache=False)
        to_cpu()
        self._offloaded = True

    def restore_to_device(self) -> None:
        """Before training: the grad buffer reallocated (zeroed) and the optimizer state back on the GPU."""
        if not self._offloaded:
            return
        _require(self.ddp, "restore_grad_buffers", "megatron DistributedDataParallel")(synchronize=False)
        _require(self.opt, "restore_from_cpu", "megatron optimizer")()
        self._offloaded = False

    def reduce_grads(self) -> None:
        """All-reduce (or reduce-scatter, distributed) the fp32 main grads over data parallel."""
        with self._scope():
            self.ddp.finish_grad_sync()

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer inside (its param_groups carry the LR): what an LR scheduler drives; with several
        (expert parallelism) a view of all their param groups."""
        inner = [_require(o, "optimizer", "megatron optimizer") for o in self.inner]
        if len(inner) == 1:
            return inner[0]
        if getattr(self, "_groups_view", None) is None:
            self._groups_view = ParamGroupsView(inner)
        return self._groups_view

    def step(self) -> float:
        """Clip (by ``clip_grad``, over this side's params only) and step; returns the pre-clip grad-norm."""
        with self._scope():
            ok, grad_norm, _zeros = self.opt.step()
        if not ok:
            raise FloatingPointError("Megatron optimizer skipped the step (inf/nan in the gradients)")
        return float(grad_norm) if grad_norm is not None else math.nan

    def state_dict(self) -> dict:
        """This DP rank's optimizer: param groups plus its shard of fp32 master weights and Adam moments, as
        CPU copies (a snapshot; a checkpoint is resumed with the same TP x DP layout)."""
        gets = [_require(o, "get_parameter_state_dp_reshardable", "megatron DistributedOptimizer") for o in self.inner]
        with self._scope():
            opt, param_states = self.opt.state_dict(), [get() for get in gets]
        return {"opt": opt, "param_state": [_snapshot_param_state(ps) for ps in param_states]}

    def load_state_dict(self, sd: dict) -> None:
        loads = [_require(o, "load_parameter_state_from_dp_reshardable", "megatron DistributedOptimizer")
                 for o in self.inner]
        if len(sd["param_state"]) != len(loads):
            raise MegatronOptimizerError(f"checkpoint holds {len(sd['param_state'])} optimizer states, this side has "
                                         f"{len(loads)} (resume with the megatron.ep it was saved with)")
        # no_grad: with fp32 params the master shard is a view of the model param (a leaf that requires grad),
        # and megatron-core's loader copies into it in place without disabling autograd
        with self._scope(), torch.no_grad():
            self.opt.load_state_dict(sd["opt"])
            for load, state in zip(loads, sd["param_state"]):
                load(state)
        for o in self.inner:
            _unshare_adam_steps(o.optimizer)


class ParamGroupsView(torch.optim.Optimizer):
    """What an LR scheduler drives when a side has several torch optimizers (dense and expert-parallel
    parameters): their param groups, the very dicts, in one list. It is never stepped itself."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):   # no Optimizer.__init__: it owns no parameters
        self._optimizers = optimizers
        self._opt_called = True   # torch's "scheduler stepped before optimizer" check: the optimizers step elsewhere

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self._optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {p: st for o in self._optimizers for p, st in o.state.items()}

    def step(self, closure=None):
        raise MegatronOptimizerError("ParamGroupsView is stepped through MegatronSideOptimizer.step")


def _unshare_adam_steps(opt: torch.optim.Optimizer) -> None:
    """One ``step`` tensor per parameter state again after a load (on the parameter's device in float32 where the
    group steps fused: torch's fused kernel reads it there, torch/optim/adam.py ``_init_group``).

    megatron-core 0.16.1 ``DistributedOptimizer.load_state_dict`` (torch-optimizer branch, i.e. without TE or
    Apex, as in this project) assigns the *same* ``step`` tensor to every parameter's state; torch's AdamW
    increments each parameter's step in place, so after a resume the shared counter would advance once per
    parameter per step and corrupt Adam's bias correction."""
    seen: set[int] = set()
    for state in opt.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(state["step"]))
    for group in opt.param_groups:
        if not group.get("fused"):
            continue
        for p in group["params"]:
            step = opt.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and (step.device != p.device or step.dtype != torch.float32):
                opt.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)


def _snapshot_param_state(state: dict) -> dict:
    """``get_parameter_state_dp_reshardable()`` -> what ``load_parameter_state_from_dp_reshardable`` reads back.

    The getter hands out the live shard tensors, one dict per parameter of each bucket; the loader also
    expects each such dict to say whether it is ``padding`` (a flag megatron-core's own dist-checkpointing
    wrapper adds, 0.16.1 ``sharded_param_state_dp_reshardable``): the getter's entries are parameters, never
    padding. Tensors are copied to the CPU so that later steps do not change the snapshot."""
    out = {}
    for key, value in state.items():
        if key in ("per_bucket_numel", "per_bucket_numel_unpadded"):
            out[key] = copy.deepcopy(value)
            continue
        out[key] = {dtype: [[{**{k: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
                                   for k, v in entry.items()}, "padding": False}
                             for entry in bucket] for bucket in buckets]
                    for dtype, buckets in value.items()}
    return out


def build_megatron_side_optimizers(model: torch.nn.Module, policy_params, head_params, *, policy_kw: dict,
                                   head_kw: dict | None, distributed: bool = True, fused_adam: bool = True):
    """(policy side, head side or None). ``*_kw``: lr, weight_decay, betas, eps, grad_clip; ``fused_adam``: torch's
    fused AdamW on GPU ranks (``fuse_torch_adam``)."""
    policy = MegatronSideOptimizer(model, model, policy_params, head_params, distributed=distributed,
                                   fused_adam=fused_adam, **policy_kw)
    head = None
    if head_params:
        head = MegatronSideOptimizer(model, model.mtp, head_params, policy_params, distributed=distributed,
                                     fused_adam=fused_adam, **head_kw)
    return policy, head
