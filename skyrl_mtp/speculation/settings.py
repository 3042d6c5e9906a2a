"""What auto k's engine-core half needs to know, carried to it inside vLLM's own config.

Why this exists: vLLM builds the scheduler (scheduler_hook.py) in the engine core process from its
VllmConfig alone. The speculation settings travel in that config's `additional_config` (the place vLLM
keeps for settings of out-of-tree code, and hashes with the rest), as one serialised `SpeculationSettings`
that rollout/config.py fills from EngineConfig, rather than as environment variables of the engine process.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from skyrl_mtp.allowed import DEFAULT_EXPLORE_BUDGET, EXPLORE_BUDGET_ALLOWED, is_explore_budget

SCHEDULER_CLS = "skyrl_mtp.speculation.scheduler_hook.AdaptiveSpeculationScheduler"
ADDITIONAL_CONFIG_KEY = "skyrl_mtp_speculation"


class AdaptiveSpeculationError(RuntimeError):
    """The vLLM code auto k relies on is missing or changed, or its engine was built without its settings."""


def require(ok: bool, what: str) -> None:
    if not ok:
        raise AdaptiveSpeculationError(f"vLLM changed: {what}; skyrl_mtp's auto k must be updated for this vLLM "
                                       "version (or set trainer.mtp.num_speculative_tokens to an int)")


@dataclass(frozen=True)
class SpeculationSettings:
    """explore_budget: trainer.mtp.explore_budget (policy.py); trace_dir: trainer.mtp.policy_trace_dir, where
    each engine core writes the calls its scheduler makes to the policy (trace.py; None: no trace)."""

    explore_budget: float = DEFAULT_EXPLORE_BUDGET
    trace_dir: str | None = None

    def __post_init__(self) -> None:
        if not is_explore_budget(self.explore_budget):
            raise ValueError(f"SpeculationSettings.explore_budget={self.explore_budget!r} is invalid: "
                             f"{EXPLORE_BUDGET_ALLOWED} (trainer.mtp.explore_budget)")
        if self.trace_dir is not None and (not isinstance(self.trace_dir, str) or not self.trace_dir.strip()):
            raise ValueError(f"SpeculationSettings.trace_dir={self.trace_dir!r} is invalid: a directory path or "
                             "None (trainer.mtp.policy_trace_dir)")

    def additional_config(self) -> dict[str, Any]:
        """The entry of vLLM's `additional_config` engine argument (JSON-serialisable, as vLLM hashes it)."""
        return {ADDITIONAL_CONFIG_KEY: asdict(self)}

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> SpeculationSettings:
        extra = getattr(vllm_config, "additional_config", None)
        raw = extra.get(ADDITIONAL_CONFIG_KEY) if isinstance(extra, dict) else None
        if not isinstance(raw, dict):
            raise AdaptiveSpeculationError(f"the engine's additional_config has no {ADDITIONAL_CONFIG_KEY!r} entry: "
                                           "build auto k's engine arguments with EngineConfig.managed_engine_kwargs")
        return cls(**raw)


def dynamic_schedule(k_max: int, max_num_seqs: int) -> list[tuple[int, int, int]]:
    """The `num_speculative_tokens_per_batch_size` that puts vLLM's scheduler in dynamic mode with every batch
    size allowed up to k_max (the adaptive scheduler picks each step's k)."""
    return [(1, max(int(max_num_seqs), 1), int(k_max))]
