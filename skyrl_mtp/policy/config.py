"""Typed, validated configuration of a Megatron policy worker (policy + decoupled MTP head)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

DRAFT_LOSS_TYPES = ("soft_ce", "hard_ce", "topk_soft_ce", "tv")
DTYPES = ("float32", "bfloat16", "float16")


class PolicyConfigError(ValueError):
    """A PolicyWorkerConfig field has a value that is not allowed."""


def _bad(field_name: str, value, allowed: str) -> PolicyConfigError:
    return PolicyConfigError(f"PolicyWorkerConfig.{field_name}={value!r} is invalid: {allowed}")


@dataclass
class PolicyWorkerConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    mtp_num_layers: int | None = None  # None: the checkpoint's num_nextn_predict_layers; 0 disables
    mtp_enabled: bool = True
    mtp_num_depths: int = 1  # draft depths trained; depth d > num layers reuses the last layer
    mtp_loss_type: str = "soft_ce"
    mtp_loss_weight: float = 1.0
    mtp_loss_topk: int = 32
    mtp_loss_chunk_size: int = 0  # 0: no chunking over tokens
    mtp_detach_trunk: bool = True
    mtp_detach_shared_output: bool = True
    mtp_separate_optimizer: bool = True
    policy_lr: float = 1e-6
    head_lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    policy_grad_clip: float = 1.0
    head_grad_clip: float = 1.0
    lr_warmup_steps: int = 0
    micro_batch_size: int = 4
    seed: int = 0
    dtype: str = "float32"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        for name in ("tp", "pp", "dp", "micro_batch_size", "mtp_num_depths"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise _bad(name, v, "must be an integer >= 1")
        if self.pp != 1:
            raise _bad("pp", self.pp, "only pipeline parallel size 1 is supported")
        if self.mtp_num_layers is not None and (not isinstance(self.mtp_num_layers, int) or self.mtp_num_layers < 0):
            raise _bad("mtp_num_layers", self.mtp_num_layers, "must be None (use the checkpoint's) or an integer >= 0")
        if self.mtp_loss_type not in DRAFT_LOSS_TYPES:
            raise _bad("mtp_loss_type", self.mtp_loss_type, f"allowed: {DRAFT_LOSS_TYPES}")
        if not isinstance(self.mtp_loss_topk, int) or self.mtp_loss_topk < 1:
            raise _bad("mtp_loss_topk", self.mtp_loss_topk, "must be an integer >= 1")
        if self.mtp_loss_chunk_size < 0:
            raise _bad("mtp_loss_chunk_size", self.mtp_loss_chunk_size, "must be >= 0 (0 = no chunking)")
        if self.mtp_loss_weight < 0:
            raise _bad("mtp_loss_weight", self.mtp_loss_weight, "must be >= 0")
        for name in ("policy_lr", "head_lr"):
            if getattr(self, name) < 0:
                raise _bad(name, getattr(self, name), "must be >= 0")
        for name in ("policy_grad_clip", "head_grad_clip"):
            if getattr(self, name) <= 0:
                raise _bad(name, getattr(self, name), "must be > 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise _bad("betas", self.betas, "must be two floats in [0, 1)")
        if self.lr_warmup_steps < 0:
            raise _bad("lr_warmup_steps", self.lr_warmup_steps, "must be >= 0")
        if self.dtype not in DTYPES:
            raise _bad("dtype", self.dtype, f"allowed: {DTYPES}")
        if not self.mtp_detach_trunk:
            raise _bad("mtp_detach_trunk", self.mtp_detach_trunk,
                       "only True is supported: the draft loss must not reach the trunk")
        if not self.mtp_detach_shared_output:
            raise _bad("mtp_detach_shared_output", self.mtp_detach_shared_output,
                       "only True is supported: a gradient into the shared output layer would change the policy")
        if self.mtp_enabled and not self.mtp_separate_optimizer:
            raise _bad("mtp_separate_optimizer", self.mtp_separate_optimizer,
                       "only True is supported: the head steps with its own optimizer")

    def to_dict(self) -> dict:
        return asdict(self)
