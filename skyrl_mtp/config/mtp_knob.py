"""Checks of the high-level `trainer.mtp` knob against the low-level keys it touches.

`trainer.mtp` says, once, whether the model drafts with its MTP head and how the head is trained.
Nothing is derived into other user keys: the engines' speculative config and the workers' draft-loss
settings are built from `trainer.mtp` by `skyrl_mtp.trainer.run_plan`, with the derived settings below
(the k the engines draft, the depths the head trains). The one low-level key that can contradict it,
`megatron.mtp_num_layers`, is checked here.
"""

from __future__ import annotations

from omegaconf import DictConfig

from skyrl_mtp.allowed import (
    DEFAULT_EXPLORE_BUDGET,
    DRAFT_SAMPLE_METHODS,
    EXPLORE_BUDGET_ALLOWED,
    is_explore_budget,
)
from skyrl_mtp.config.checker import Checker
from skyrl_mtp.config.schema import MTPConfig

DEFAULT_MAX_SPECULATIVE_TOKENS = MTPConfig().max_speculative_tokens
DEFAULT_IDLE_HEAD_TRAIN_BUDGET = MTPConfig().idle_head_train_budget


def _int_at_least_1(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def knob_kind(c: Checker) -> str:
    return str(c.cfg.trainer.drafter.kind)


def mtp_checks(c: Checker) -> None:
    """The checks of `trainer.mtp` and of the key that can contradict it (the key the user wrote is the one named)."""
    knob = c.cfg.trainer.mtp
    on, auto = bool(knob.enabled), knob.num_speculative_tokens == "auto"
    c.check("trainer.mtp.num_speculative_tokens", lambda k: k == "auto" or _int_at_least_1(k),
            "must be >= 1 (an int), or 'auto' (k chosen per engine step up to "
            "trainer.mtp.max_speculative_tokens) when trainer.mtp.enabled=true "
            "(set enabled=false to turn MTP off)", when=on)
    c.choice("trainer.mtp.draft_sample_method", DRAFT_SAMPLE_METHODS, when=on)
    c.check("trainer.mtp.max_speculative_tokens", _int_at_least_1,
            "must be an int >= 1 (the maximum k of trainer.mtp.num_speculative_tokens=auto)", when=on and auto)
    c.check("megatron.mtp_num_layers", lambda v: v is None or v != 0,
            "contradicts trainer.mtp.enabled=true; leave it null (use the checkpoint's MTP layers) or >= 1",
            when=on and knob_kind(c) == "mtp")
    c.check("megatron.mtp_num_layers", lambda v: v is None or v <= 0,
            "contradicts trainer.mtp.enabled=false; leave it null or set 0", when=not on)
    c.check("trainer.mtp.loss_position_fraction", lambda v: isinstance(v, (int, float)) and 0.0 < v <= 1.0,
            "must be in (0, 1] (the fraction of draft positions the head's loss is computed on)")
    c.check("trainer.mtp.loss_depth_decay",
            lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and 0.0 < v <= 1.0,
            "must be in (0, 1] (draft depth d's loss weighs loss_depth_decay ** (d - 1))")
    c.check("trainer.mtp.idle_head_train_budget",
            lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and 0.0 < v <= 1.0,
            "must be in (0, 1] (the share of each step's time spent keeping an idle head aligned; "
            "0 would leave a head that stopped paying untrained for good)")
    c.check("trainer.mtp.explore_budget", is_explore_budget,
            f"must be {EXPLORE_BUDGET_ALLOWED} (the share of the engines' time auto k may spend "
            "exploring; 0: only where exploring is predicted to cost nothing)")
    c.check("trainer.mtp.explore_budget", lambda v: v == DEFAULT_EXPLORE_BUDGET,
            "applies only with trainer.mtp.num_speculative_tokens=auto (a fixed k explores "
            "nothing); leave it unset", when=on and not auto)
    c.check("trainer.mtp.max_speculative_tokens", lambda v: v == DEFAULT_MAX_SPECULATIVE_TOKENS,
            "applies only with trainer.mtp.num_speculative_tokens=auto (a fixed k is the most the engines draft); "
            "leave it unset", when=on and not auto)
    c.check("trainer.mtp.idle_head_train_budget", lambda v: v == DEFAULT_IDLE_HEAD_TRAIN_BUDGET,
            "applies only with trainer.mtp.num_speculative_tokens=auto and train_depths=null (otherwise the head "
            "trains every step); leave it unset", when=on and not (auto and knob.train_depths is None))
    c.check("trainer.mtp.policy_trace_dir", lambda v: v is None or (isinstance(v, str) and bool(v.strip())),
            "must be a directory path, or null (no trace)")
    c.check("trainer.mtp.policy_trace_dir", lambda v: v is None,
            "applies only with trainer.mtp.enabled=true and num_speculative_tokens=auto (it records "
            "the calls to the engines' choice of k); leave it null", when=not (on and auto))
    c.check("trainer.mtp.train_depths", lambda v: v is None or v >= 1,
            "must be >= 1, or null (= trainer.mtp.num_speculative_tokens)")


def adaptive_speculation(cfg: DictConfig) -> bool:
    """trainer.mtp.num_speculative_tokens=auto: k chosen per engine step (speculation/policy.py)."""
    return cfg.trainer.mtp.num_speculative_tokens == "auto"


def max_speculative_tokens(cfg: DictConfig) -> int:
    """The largest k the engines may draft: k, or trainer.mtp.max_speculative_tokens under auto."""
    mtp = cfg.trainer.mtp
    return int(mtp.max_speculative_tokens) if adaptive_speculation(cfg) else int(mtp.num_speculative_tokens)


def train_depths(cfg: DictConfig) -> int:
    """Draft depths the head is trained on: trainer.mtp.train_depths, or (null) the largest k drafted (under
    auto the most depths: each step trains those the engines drafted, head_depths_follow_engines)."""
    mtp = cfg.trainer.mtp
    if mtp.train_depths is not None:
        return int(mtp.train_depths)
    return max(max_speculative_tokens(cfg), 1)


def rollout_speculative_tokens(cfg: DictConfig) -> int:
    """Tokens the engines draft per step (the maximum under auto) when the head drafts in rollouts, else 0."""
    mtp = cfg.trainer.mtp
    return max_speculative_tokens(cfg) if mtp.enabled and mtp.draft_in_rollouts else 0
