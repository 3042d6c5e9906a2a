"""Checks of the high-level `trainer.mtp` knob against the low-level keys it touches.

`trainer.mtp` says, once, whether the model drafts with its MTP head and how the head is trained.
Nothing is derived into other user keys: the engines' speculative config and the workers' draft-loss
settings are built from `trainer.mtp` by `skyrl_mtp.trainer.run_plan`. The one low-level key that can
contradict it, `megatron.mtp_num_layers`, is checked here.
"""

from __future__ import annotations

from omegaconf import DictConfig

from skyrl_mtp.allowed import (
    DEFAULT_EXPLORE_BUDGET,
    DRAFT_SAMPLE_METHODS,
    EXPLORE_BUDGET_ALLOWED,
    is_explore_budget,
)
from skyrl_mtp.errors import problem


def mtp_problems(cfg: DictConfig) -> list[str]:
    """One problem per key that contradicts `trainer.mtp` (the key the user wrote is the one named)."""
    knob, layers = cfg.trainer.mtp, cfg.megatron.mtp_num_layers
    out: list[str] = []
    if knob.enabled:
        k = knob.num_speculative_tokens
        if not (k == "auto" or (isinstance(k, int) and not isinstance(k, bool) and k >= 1)):
            out.append(problem("trainer.mtp.num_speculative_tokens", k,
                               "must be >= 1 (an int), or 'auto' (k chosen per engine step up to "
                               "trainer.mtp.max_speculative_tokens) when trainer.mtp.enabled=true "
                               "(set enabled=false to turn MTP off)"))
        if knob.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            out.append(problem("trainer.mtp.draft_sample_method", knob.draft_sample_method,
                               f"must be one of {list(DRAFT_SAMPLE_METHODS)}"))
        m = knob.max_speculative_tokens
        if k == "auto" and not (isinstance(m, int) and not isinstance(m, bool) and m >= 1):
            out.append(problem("trainer.mtp.max_speculative_tokens", m,
                               "must be an int >= 1 (the maximum k of trainer.mtp.num_speculative_tokens=auto)"))
        if layers is not None and layers == 0:
            out.append(problem("megatron.mtp_num_layers", 0, "contradicts trainer.mtp.enabled=true; leave it null "
                               "(use the checkpoint's MTP layers) or >= 1"))
    elif layers is not None and layers > 0:
        out.append(problem("megatron.mtp_num_layers", layers,
                           "contradicts trainer.mtp.enabled=false; leave it null or set 0"))
    if not (isinstance(knob.loss_position_fraction, (int, float)) and 0.0 < knob.loss_position_fraction <= 1.0):
        out.append(problem("trainer.mtp.loss_position_fraction", knob.loss_position_fraction,
                           "must be in (0, 1] (the fraction of draft positions the head's loss is computed on)"))
    decay = knob.loss_depth_decay
    if isinstance(decay, bool) or not (isinstance(decay, (int, float)) and 0.0 < decay <= 1.0):
        out.append(problem("trainer.mtp.loss_depth_decay", decay,
                           "must be in (0, 1] (draft depth d's loss weighs loss_depth_decay ** (d - 1))"))
    budget = knob.idle_head_train_budget
    if isinstance(budget, bool) or not (isinstance(budget, (int, float)) and 0.0 < budget <= 1.0):
        out.append(problem("trainer.mtp.idle_head_train_budget", budget,
                           "must be in (0, 1] (the share of each step's time spent keeping an idle head aligned; "
                           "0 would leave a head that stopped paying untrained for good)"))
    explore = knob.explore_budget
    if not is_explore_budget(explore):
        out.append(problem("trainer.mtp.explore_budget", explore,
                           f"must be {EXPLORE_BUDGET_ALLOWED} (the share of the engines' time auto k may spend "
                           "exploring; 0: only where exploring is predicted to cost nothing)"))
    elif explore != DEFAULT_EXPLORE_BUDGET and knob.enabled and knob.num_speculative_tokens != "auto":
        out.append(problem("trainer.mtp.explore_budget", explore,
                           "applies only with trainer.mtp.num_speculative_tokens=auto (a fixed k explores "
                           "nothing); leave it unset"))
    trace = knob.policy_trace_dir
    if trace is not None and (not isinstance(trace, str) or not trace.strip()):
        out.append(problem("trainer.mtp.policy_trace_dir", trace, "must be a directory path, or null (no trace)"))
    elif trace is not None and not (knob.enabled and knob.num_speculative_tokens == "auto"):
        out.append(problem("trainer.mtp.policy_trace_dir", trace,
                           "applies only with trainer.mtp.enabled=true and num_speculative_tokens=auto (it records "
                           "the calls to the engines' choice of k); leave it null"))
    if knob.train_depths is not None and knob.train_depths < 1:
        out.append(problem("trainer.mtp.train_depths", knob.train_depths,
                           "must be >= 1, or null (= trainer.mtp.num_speculative_tokens)"))
    return out
