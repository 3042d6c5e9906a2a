"""The one table of allowed values for named settings, and the one formatter of a bad-value message.

The run config (config/schema.py, config/validation.py), `PolicyWorkerConfig` and `EngineConfig` all
check names against these tuples and word their errors with `problem`, so a value allowed in one place
is allowed in all of them and every message reads the same way. Import-light on purpose: Ray actors
import it through the component configs.
"""

from __future__ import annotations

from typing import Any

from skyrl_mtp.errors import problem  # noqa: F401 - the one formatter, re-exported beside the tables

DRAFT_LOSS_TYPES = ("soft_ce", "hard_ce", "topk_soft_ce", "tv")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")   # vLLM's SpeculativeConfig.draft_sample_method
ADVANTAGE_ESTIMATORS = ("grpo",)
POLICY_LOSS_TYPES = ("dapo", "ppo")
LOSS_REDUCTIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
GENERATOR_BACKENDS = ("vllm",)
ENVIRONMENTS = ("math", "search")
LOGGER_BACKENDS = ("console", "jsonl", "wandb")
WANDB_MODES = ("offline", "online", "disabled")
DTYPES = ("float32", "bfloat16", "float16")
LR_SCHEDULES = ("constant", "linear", "cosine")
RESUME_MODES = ("auto", "never")
SYNTHETIC_TASKS = ("arithmetic", "search")
SEARCH_ON_FAILURE = ("score", "raise")
MODEL_RUNNERS = ("v1", "v2")   # vLLM's model runners (generator.model_runner, EngineConfig.model_runner)
# megatron.layer_impl: the policy's layer spec / core attention (models/families/megatron_common.py)
LAYER_IMPLS = ("local", "sdpa", "transformer_engine")
ASYNC_RL_MODES = ("sync", "one_step_off", "fully_async")     # trainer.async_rl.mode
OFF_POLICY_CORRECTIONS = ("none", "tis", "decoupled")   # algorithm.off_policy.correction
TIS_LEVELS = ("token", "sequence")            # algorithm.off_policy.tis_level
# trainer.drafter.kind: the model's own MTP head, or an EAGLE-3 / DFlash drafter trained beside it
DRAFTER_KINDS = ("mtp", "eagle3", "dflash")

# Tokens per chunk of the draft loss: an int (0 = all tokens at once) or "auto", as many tokens as keep
# one chunk's logits on a rank's vocab shard at MTP_LOSS_CHUNK_AUTO_ELEMENTS (512 MiB in fp32): few chunks
# on a small vocabulary (each chunk costs a few dozen kernel launches), bounded memory on a large one.
# The one default, used by the run config and by PolicyWorkerConfig alike.
DEFAULT_MTP_LOSS_CHUNK_SIZE = "auto"
MTP_LOSS_CHUNK_AUTO_ELEMENTS = 2**27
MTP_LOSS_CHUNK_SIZE_ALLOWED = ("an int >= 0 (tokens per chunk of the draft loss; 0 = one chunk) or 'auto' "
                               f"(as many tokens as keep a chunk's logits at {MTP_LOSS_CHUNK_AUTO_ELEMENTS} elements)")


# The exploration budget of auto k (trainer.mtp.explore_budget, EngineConfig.explore_budget and the engine
# core's SpeculationPolicy): a share of the engines' time.
DEFAULT_EXPLORE_BUDGET = 0.02
MAX_EXPLORE_BUDGET = 0.5
EXPLORE_BUDGET_ALLOWED = f"a share of engine time in [0, {MAX_EXPLORE_BUDGET}]"


def is_explore_budget(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0.0 <= value <= MAX_EXPLORE_BUDGET)


def is_chunk_size(value: Any) -> bool:
    """A valid draft-loss chunk size: an int >= 0, or "auto"."""
    return value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
