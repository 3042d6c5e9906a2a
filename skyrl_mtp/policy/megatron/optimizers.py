"""Two independent optimizers: one for the policy (trunk), one for the MTP head.

On CPU ranks both are torch AdamW (``TorchSideOptimizer``), each with its own hyper-parameters, LR schedule
(constant / linear / cosine after a linear warmup) and grad-norm clipping. GPU ranks (and CPU ranks that opt
in, for tests) take Megatron's DDP + distributed optimizer instead (``distributed_optimizer.py``); which one a
rank gets is decided by ``policy/megatron/device.py``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from skyrl_mtp.allowed import LR_SCHEDULES

HEAD_PREFIX = "mtp."


def split_params(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Parameter]], list[tuple[str, torch.nn.Parameter]]]:
    """(policy params, MTP head params), by name."""
    policy, head = [], []
    for n, p in model.named_parameters():
        (head if n.startswith(HEAD_PREFIX) else policy).append((n, p))
    return policy, head


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def build_optimizer(params: list[torch.nn.Parameter], *, lr: float, weight_decay: float,
                    betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    """AdamW; torch's fused kernel where every parameter allows it (CPU and CUDA, floating dtypes): on
    CPU it is several times faster than the per-tensor loop, with the same update rule."""
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype in _FUSED_DTYPES for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps,
                             fused=fused or None)


def lr_factor(step: int, *, schedule: str, warmup_steps: int, decay_steps: int) -> float:
    """Multiplier of the base LR at optimizer step ``step`` (0-based).

    Linear warmup from 1/warmup_steps to 1 over the first ``warmup_steps`` steps, then: ``constant``
    stays at 1; ``linear`` falls linearly and ``cosine`` along a half cosine towards 0 at step
    ``decay_steps`` (the planned number of optimizer steps of the run, warmup included).
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule {schedule!r} is not one of {LR_SCHEDULES}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_scheduler(opt: torch.optim.Optimizer, *, schedule: str, warmup_steps: int,
                 decay_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR stepping ``lr_factor``; its state_dict (the step count) is what a checkpoint keeps."""
    if schedule != "constant" and decay_steps < 1:
        raise ValueError(f"lr schedule {schedule!r} needs decay_steps >= 1 (the run's optimizer steps), got {decay_steps}")
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: lr_factor(step, schedule=schedule, warmup_steps=warmup_steps, decay_steps=decay_steps))


def is_expert_parallel(p: torch.nn.Parameter) -> bool:
    """A routed expert's parameter spread over expert-parallel ranks: megatron-core marks it ``allreduce=False``
    (its data-parallel replicas are the ranks holding the same experts, not the whole data-parallel group)."""
    return not getattr(p, "allreduce", True)


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def allreduce_grads(params: list[torch.nn.Parameter], group, expert_group=None) -> None:
    """Sum gradients across a data-parallel group (the loss is already normalised globally); expert-parallel
    parameters across ``expert_group``, the ranks that hold the same experts."""
    for p in params:
        g = expert_group if is_expert_parallel(p) else group
        if p.grad is not None and _size(g) > 1:
            dist.all_reduce(p.grad, group=g)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, tp_group=None, ep_group=None,
                   pp_group=None) -> float:
    """Global L2 grad-norm (TP-aware: sharded params summed across ranks, replicated ones once; expert-parallel
    params summed across the EP group, each rank holding other experts; summed over the pipeline stages of
    ``pp_group``, which hold disjoint params), then clip.

    With one TP, EP and pipeline rank this is exactly ``torch.nn.utils.clip_grad_norm_``.
    """
    grads = [p for p in params if p.grad is not None]
    tp_size, ep_size, pp_size = _size(tp_group), _size(ep_group), _size(pp_group)
    if pp_size == 1 and not grads:
        return 0.0
    if tp_size == 1 and ep_size == 1 and pp_size == 1:
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))
    tp_rank = dist.get_rank(tp_group) if tp_size > 1 else 0
    dev = grads[0].grad.device if grads else params[0].device   # a collective's tensor: on the grads' device
    dense, expert = torch.zeros((), dtype=torch.float64, device=dev), torch.zeros((), dtype=torch.float64, device=dev)
    for p in grads:
        if ep_size > 1 and is_expert_parallel(p):
            expert += p.grad.detach().double().pow(2).sum()
        elif tp_size == 1 or getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            dense += p.grad.detach().double().pow(2).sum()
    if tp_size > 1:
        dist.all_reduce(dense, group=tp_group)
    if ep_size > 1:
        dist.all_reduce(expert, group=ep_group)
    sq = dense + expert
    if pp_size > 1:   # every stage takes part, with or without gradients of its own
        dist.all_reduce(sq, group=pp_group)
    total = math.sqrt(float(sq))
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        for p in grads:
            p.grad.mul_(coef)
    return total


class TorchSideOptimizer:
    """One side (policy or MTP head) on the torch path: AdamW over ``params``, gradients summed over data
    parallel by ``allreduce_grads``, clipped by ``clip_grad_norm`` over this side's params only (on every
    pipeline stage of ``pp_group`` for the policy, whose params the stages split).
    ``distributed_optimizer.MegatronSideOptimizer`` is the GPU twin with the same methods."""

    def __init__(self, params: list[torch.nn.Parameter], *, lr: float, weight_decay: float, betas, eps: float,
                 grad_clip: float, dp_group, tp_group, ep_group=None, expert_dp_group=None, pp_group=None,
                 name: str = "policy"):
        self.params, self.grad_clip, self.dp_group, self.tp_group = params, grad_clip, dp_group, tp_group
        self.ep_group, self.expert_dp_group, self.pp_group = ep_group, expert_dp_group, pp_group
        self.opt = build_optimizer(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        self.name = name

    def _move_state(self, device: torch.device) -> None:
        for state in self.opt.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:   # fused AdamW keeps its step count as is
                    state[key] = value.to(device)

    def offload_to_host(self) -> None:
        """Colocated engines awake: the grads are spent once the step is taken (freed), Adam's moments go to host
        memory (the side's parameters stay: the engines' weight sync reads them)."""
        self.zero_grad()
        self._move_state(torch.device("cpu"))

    def restore_to_device(self) -> None:
        self._move_state(self.params[0].device)

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        return self.opt

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def reduce_grads(self) -> None:
        allreduce_grads(self.params, self.dp_group, self.expert_dp_group)

    def step(self) -> float:
        """Clip, step; the pre-clip global grad-norm."""
        norm = clip_grad_norm(self.params, self.grad_clip, self.tp_group, self.ep_group, self.pp_group)
        self.opt.step()
        return norm

    def state_dict(self) -> dict:
        return self.opt.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.opt.load_state_dict(sd)
