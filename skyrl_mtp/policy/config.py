"""Typed, validated configuration of a Megatron policy worker (policy + decoupled MTP head).

A run builds it from its config with `skyrl_mtp.trainer.run_plan.policy_worker_config` (the one place that
maps run keys to these fields). The policy's optimizer fields are `weight_decay`, `betas`, `eps`,
`lr_warmup_steps`, `lr_schedule`; the head's are the `head_*` ones; both decay over `lr_decay_steps`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from skyrl_mtp.allowed import (
    DEFAULT_MTP_LOSS_CHUNK_SIZE,
    DRAFT_LOSS_TYPES,
    DRAFTER_KINDS,
    DTYPES,
    LAYER_IMPLS,
    LR_SCHEDULES,
    MODEL_RUNNERS,
    MTP_LOSS_CHUNK_SIZE_ALLOWED,
    is_chunk_size,
    problem,
)


class PolicyConfigError(ValueError):
    """A PolicyWorkerConfig field has a value that is not allowed."""


def _bad(field_name: str, value, allowed: str) -> PolicyConfigError:
    return PolicyConfigError(problem(f"PolicyWorkerConfig.{field_name}", value, allowed))


@dataclass
class PolicyWorkerConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1  # expert parallel size (MoE models): spreads the routed experts over ranks; divides tp * dp
    moe_aux_loss_coeff: float = 0.0  # > 0: megatron-core's sequence-level load-balancing loss on every router
    draft_runner: str = "v1"  # the vLLM model runner whose MTP drafter the replay follows ("v1" / "v2")
    mtp_num_layers: int | None = None  # None: the checkpoint's num_nextn_predict_layers; 0 disables
    mtp_enabled: bool = True
    # the drafter trained beside the policy (run key trainer.drafter.kind): "mtp" = the model's own MTP layers (per
    # mtp_enabled), "eagle3" = an EAGLE-3 drafter (policy/drafter_training.py), trained on the draft-loss settings
    # below (mtp_num_depths = its test-time-training unroll) with the head_* optimizer settings
    drafter_kind: str = "mtp"
    drafter_init: str | None = None   # an exported drafter to start from; None: initialised from `seed`
    drafter_layer_ids: tuple[int, ...] | None = None   # the target layers it reads (vLLM's ids); None: the default
    drafter_num_layers: int = 1        # dflash: the drafter's layers
    drafter_block_size: int = 8        # dflash: the anchor plus block_size - 1 mask slots
    drafter_anchors: int = 32          # dflash: blocks trained per sequence
    drafter_mask_token_id: int | None = None   # dflash: the mask slots' token; None: the vocabulary's last row
    mtp_num_depths: int = 1  # draft depths trained (run key trainer.mtp.train_depths); depth d > num layers reuses the last layer
    mtp_loss_type: str = "soft_ce"
    mtp_loss_weight: float = 1.0
    mtp_loss_topk: int = 32
    mtp_loss_chunk_size: int | str = DEFAULT_MTP_LOSS_CHUNK_SIZE  # tokens per chunk; 0: no chunking; auto: by vocab
    mtp_loss_position_fraction: float = 1.0  # < 1: draft loss on that fraction of positions (run key trainer.mtp.loss_position_fraction)
    mtp_loss_depth_decay: float = 1.0  # depth d's draft loss weighs this ** (d - 1) (run key trainer.mtp.loss_depth_decay)
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
    lr_schedule: str = "constant"
    head_weight_decay: float = 0.0
    head_betas: tuple[float, float] = (0.9, 0.999)
    head_eps: float = 1e-8
    head_lr_warmup_steps: int = 0
    head_lr_schedule: str = "constant"
    lr_decay_steps: int = 0  # optimizer steps over which linear/cosine schedules decay to 0 (the run's total)
    export_hf: bool = True  # checkpoints also hold an HF export of the policy (hf/)
    export_draft_head: bool = True  # ... and the MTP head alone (draft_head/)
    micro_batch_size: int = 4
    recompute_activations: bool = False  # Megatron full activation recompute (run key megatron.recompute_activations)
    # the layers (run key megatron.layer_impl): "local" (megatron-core's local spec, materialised attention scores),
    # "sdpa" (the local spec with torch's scaled_dot_product_attention as core attention) or "transformer_engine";
    # the worker checks on its node that the one named is usable (megatron_common.check_layer_impl)
    layer_impl: str = "local"
    # GPU ranks: the Megatron optimizer's torch AdamW (Megatron's fallback without TE / apex) steps with torch's fused
    # kernel (no fp32 temporary of every parameter); False: torch's foreach path, as Megatron builds it
    fused_adam: bool = True
    # GPU ranks: megatron-core's fused SwiGLU in every MLP (bias_activation_fusion); CPU ranks keep the unfused one
    fused_swiglu: bool = True
    # colocated GPU runs: grads and optimizer state go to host memory while the engines are awake (the memory plan
    # decides: policy/megatron/device.py hand_over_to_engines)
    offload_while_engines_awake: bool = False
    seed: int = 0
    dtype: str = "float32"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        self.head_betas = tuple(self.head_betas)
        for name in ("tp", "pp", "dp", "micro_batch_size", "mtp_num_depths"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise _bad(name, v, "must be an integer >= 1")
        if not isinstance(self.ep, int) or self.ep < 1 or (self.tp * self.dp) % self.ep:
            raise _bad("ep", self.ep, f"must be an integer >= 1 dividing tp * dp = {self.tp * self.dp}")
        if not 0.0 <= float(self.moe_aux_loss_coeff):
            raise _bad("moe_aux_loss_coeff", self.moe_aux_loss_coeff, "must be >= 0")
        if self.draft_runner not in MODEL_RUNNERS:
            raise _bad("draft_runner", self.draft_runner, f"allowed: {MODEL_RUNNERS}")
        if self.mtp_num_layers is not None and (not isinstance(self.mtp_num_layers, int) or self.mtp_num_layers < 0):
            raise _bad("mtp_num_layers", self.mtp_num_layers, "must be None (use the checkpoint's) or an integer >= 0")
        if self.drafter_kind not in DRAFTER_KINDS:
            raise _bad("drafter_kind", self.drafter_kind, f"allowed: {DRAFTER_KINDS}")
        if self.drafter_kind != "mtp":
            if self.mtp_enabled:
                raise _bad("mtp_enabled", self.mtp_enabled, f"must be False with drafter_kind={self.drafter_kind!r} "
                           "(the drafter replaces the model's MTP layers)")
            if self.pp != 1:
                raise _bad("pp", self.pp, f"must be 1 with drafter_kind={self.drafter_kind!r} (the drafter reads "
                           "hidden states of every stage)")
        elif self.drafter_init is not None or self.drafter_layer_ids is not None:
            raise _bad("drafter_init" if self.drafter_init is not None else "drafter_layer_ids",
                       self.drafter_init if self.drafter_init is not None else self.drafter_layer_ids,
                       "must be None with drafter_kind='mtp' (the MTP head is the checkpoint's own)")
        if self.drafter_layer_ids is not None:
            self.drafter_layer_ids = tuple(self.drafter_layer_ids)
        for name, low in (("drafter_num_layers", 1), ("drafter_block_size", 2), ("drafter_anchors", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise _bad(name, v, f"must be an integer >= {low}")
        if self.drafter_kind != "dflash" and self.drafter_num_layers != 1:
            raise _bad("drafter_num_layers", self.drafter_num_layers, f"must be 1 with drafter_kind="
                       f"{self.drafter_kind!r} (one drafter layer)")
        if self.mtp_loss_type not in DRAFT_LOSS_TYPES:
            raise _bad("mtp_loss_type", self.mtp_loss_type, f"allowed: {DRAFT_LOSS_TYPES}")
        if not isinstance(self.mtp_loss_topk, int) or self.mtp_loss_topk < 1:
            raise _bad("mtp_loss_topk", self.mtp_loss_topk, "must be an integer >= 1")
        if not 0.0 < float(self.mtp_loss_position_fraction) <= 1.0:
            raise _bad("mtp_loss_position_fraction", self.mtp_loss_position_fraction, "must be in (0, 1]")
        if not 0.0 < float(self.mtp_loss_depth_decay) <= 1.0:
            raise _bad("mtp_loss_depth_decay", self.mtp_loss_depth_decay, "must be in (0, 1]")
        if not is_chunk_size(self.mtp_loss_chunk_size):
            raise _bad("mtp_loss_chunk_size", self.mtp_loss_chunk_size, f"must be {MTP_LOSS_CHUNK_SIZE_ALLOWED}")
        if self.mtp_loss_weight < 0:
            raise _bad("mtp_loss_weight", self.mtp_loss_weight, "must be >= 0")
        for name in ("policy_lr", "head_lr"):
            if getattr(self, name) < 0:
                raise _bad(name, getattr(self, name), "must be >= 0")
        for name in ("policy_grad_clip", "head_grad_clip"):
            if getattr(self, name) <= 0:
                raise _bad(name, getattr(self, name), "must be > 0")
        for name in ("betas", "head_betas"):
            betas = getattr(self, name)
            if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
                raise _bad(name, betas, "must be two floats in [0, 1)")
        for name in ("weight_decay", "head_weight_decay", "lr_warmup_steps", "head_lr_warmup_steps", "lr_decay_steps"):
            if getattr(self, name) < 0:
                raise _bad(name, getattr(self, name), "must be >= 0")
        for name in ("eps", "head_eps"):
            if getattr(self, name) <= 0:
                raise _bad(name, getattr(self, name), "must be > 0")
        for name in ("lr_schedule", "head_lr_schedule"):
            if getattr(self, name) not in LR_SCHEDULES:
                raise _bad(name, getattr(self, name), f"allowed: {LR_SCHEDULES}")
            if getattr(self, name) != "constant" and self.lr_decay_steps < 1:
                raise _bad("lr_decay_steps", self.lr_decay_steps,
                           f"must be >= 1 with {name}={getattr(self, name)!r} (the run's planned optimizer steps)")
        if self.dtype not in DTYPES:
            raise _bad("dtype", self.dtype, f"allowed: {DTYPES}")
        for name in ("recompute_activations", "offload_while_engines_awake", "fused_adam", "fused_swiglu"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "expected True or False")
        if self.layer_impl not in LAYER_IMPLS:
            raise _bad("layer_impl", self.layer_impl, f"allowed: {LAYER_IMPLS}")
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
