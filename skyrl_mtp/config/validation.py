"""Semantic validation of a composed config, run once before any actor or engine starts.

Every check reports the full key, the offending value and what is allowed; all problems are
collected and raised together so a user fixes a recipe in one pass.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from skyrl_mtp.config import schema as S
from skyrl_mtp.config.errors import ConfigError, problem


class _Checker:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.problems: list[str] = []

    def get(self, key: str) -> Any:
        return OmegaConf.select(self.cfg, key)

    def check(self, key: str, ok: Callable[[Any], bool], allowed: str) -> None:
        value = self.get(key)
        if not ok(value):
            self.problems.append(problem(key, value, allowed))

    def choice(self, key: str, choices: tuple[str, ...], optional: bool = False) -> None:
        self.check(key, lambda v: (optional and v is None) or v in choices,
                   f"must be one of {list(choices)}" + (" or null" if optional else ""))

    def at_least(self, key: str, low: float, optional: bool = False) -> None:
        self.check(key, lambda v: (optional and v is None) or (v is not None and v >= low),
                   f"must be >= {low}" + (" or null" if optional else ""))

    def existing_path(self, key: str, value: Any = None) -> None:
        value = self.get(key) if value is None else value
        if value is not None and not Path(str(value)).exists():
            self.problems.append(problem(key, value, "path does not exist"))


# Recipes for real models mark the paths only the user knows with a string value starting with this.
REQUIRED_PREFIX = "REQUIRED:"


def required_placeholders(cfg: DictConfig) -> list[str]:
    """One problem per value a recipe left for the user to set (a string starting with 'REQUIRED:')."""
    out: list[str] = []

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{key}[{i}]")
        elif isinstance(node, str) and node.startswith(REQUIRED_PREFIX):
            base = key.split("[")[0]
            example = f"{base}=[/your/file,...]" if "[" in key else f"{base}=/your/path"
            out.append(problem(key, node, f"this recipe leaves it for you to set; pass {example} on the command line"))

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return out


def validate_config(cfg: DictConfig) -> None:
    """Raise ConfigError naming every invalid key of `cfg` (after `propagate_mtp_knob`)."""
    placeholders = required_placeholders(cfg)
    if placeholders:     # the other checks would only add noise about the same placeholder paths
        raise ConfigError(placeholders)
    c = _Checker(cfg)

    # trainer
    c.at_least("trainer.total_steps", 1)
    c.at_least("trainer.epochs", 1)
    c.at_least("trainer.train_batch_size", 1)
    c.at_least("trainer.eval_every_n_steps", 0)
    c.at_least("trainer.eval_batch_size", 1)
    mini = cfg.trainer.policy_mini_batch_size
    if mini is not None and not (1 <= mini <= cfg.trainer.train_batch_size):
        c.problems.append(problem("trainer.policy_mini_batch_size", mini,
                                  f"must be null or in [1, trainer.train_batch_size={cfg.trainer.train_batch_size}]"))
    c.choice("trainer.resume", S.RESUME_MODES)
    c.at_least("trainer.checkpoint.every_n_steps", 0)
    c.at_least("trainer.checkpoint.keep_last", 1)
    c.at_least("trainer.warm_start.steps", 0)
    c.check("trainer.warm_start.lr", lambda v: v > 0, "must be > 0")
    c.at_least("trainer.warm_start.batch_size", 1)
    for key in ("policy_num_workers", "cpus_per_policy_worker", "cpus_per_engine"):
        c.at_least(f"trainer.placement.{key}", 1)
    for key in ("gpus_per_policy_worker", "gpus_per_engine"):
        c.at_least(f"trainer.placement.{key}", 0)
    from skyrl_mtp.cluster.placement import placement_problems  # lazy: placement imports config.errors

    c.problems += placement_problems(cfg)   # GPU/CPU consistency, GPUs per engine = TP, colocation shape
    c.choice("trainer.mtp.loss_type", S.DRAFT_LOSS_TYPES)
    c.at_least("trainer.mtp.loss_weight", 0.0)
    if cfg.trainer.mtp.enabled:
        c.at_least("trainer.mtp.num_speculative_tokens", 1)

    # megatron
    for key in ("tp", "pp", "cp", "dp", "micro_batch_size"):
        c.at_least(f"megatron.{key}", 1)
    for key, what in (("pp", "pipeline"), ("cp", "context")):   # the policy worker has no pp/cp yet
        c.check(f"megatron.{key}", lambda v: v is None or v < 1 or v == 1,
                f"only 1 is supported: {what} parallelism is not implemented by the policy worker "
                "(scale with megatron.tp and megatron.dp)")
    c.choice("megatron.dtype", S.DTYPES)
    c.at_least("megatron.mtp_num_layers", 0, optional=True)
    c.choice("megatron.mtp_loss_type", S.DRAFT_LOSS_TYPES, optional=True)
    c.at_least("megatron.mtp_loss_weight", 0.0, optional=True)
    c.at_least("megatron.mtp_loss_topk", 1)
    c.at_least("megatron.mtp_loss_chunk_size", 0)
    for opt in ("policy_optimizer", "head_optimizer"):
        c.check(f"megatron.{opt}.lr", lambda v: v >= 0, "must be >= 0")
        c.at_least(f"megatron.{opt}.weight_decay", 0.0)
        c.check(f"megatron.{opt}.grad_clip", lambda v: v > 0, "must be > 0")
        c.check(f"megatron.{opt}.eps", lambda v: v > 0, "must be > 0")
        c.check(f"megatron.{opt}.betas", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
                "must be two numbers in [0, 1)")
        c.choice(f"megatron.{opt}.lr_schedule", S.LR_SCHEDULES)
        c.at_least(f"megatron.{opt}.warmup_steps", 0)
    meg = cfg.megatron
    world = cfg.trainer.placement.policy_num_workers
    layout = meg.tp * meg.pp * meg.cp * meg.dp
    if min(meg.tp, meg.pp, meg.cp, meg.dp) >= 1 and layout != world:
        c.problems.append(problem(
            "megatron.dp", meg.dp,
            f"tp*pp*cp*dp = {meg.tp}*{meg.pp}*{meg.cp}*{meg.dp} = {layout} must equal "
            f"trainer.placement.policy_num_workers = {world} (the policy world size)"))
    if meg.dp >= 1 and cfg.trainer.train_batch_size >= 1:
        seqs = cfg.trainer.train_batch_size * max(cfg.generator.n_samples_per_prompt, 1)
        if seqs % meg.dp != 0:
            c.problems.append(problem(
                "trainer.train_batch_size", cfg.trainer.train_batch_size,
                f"train_batch_size * generator.n_samples_per_prompt = {seqs} sequences must be divisible by megatron.dp={meg.dp}"))

    # generator
    c.choice("generator.backend", S.GENERATOR_BACKENDS)
    c.at_least("generator.num_engines", 1)
    c.at_least("generator.tensor_parallel_size", 1)
    c.at_least("generator.n_samples_per_prompt", 1)
    c.at_least("generator.max_turns", 1)
    c.at_least("generator.max_model_len", 16)
    c.at_least("generator.max_num_seqs", 1)
    c.at_least("generator.kv_cache_memory_mb", 1)
    c.choice("generator.dtype", S.DTYPES)
    for which in ("sampling", "eval_sampling"):
        c.at_least(f"generator.{which}.temperature", 0.0)
        c.check(f"generator.{which}.top_p", lambda v: 0 < v <= 1, "must be in (0, 1]")
        c.check(f"generator.{which}.top_k", lambda v: v == -1 or v >= 1, "must be -1 (off) or >= 1")
        c.at_least(f"generator.{which}.max_tokens", 1)
    if cfg.generator.sampling.max_tokens >= 1 and cfg.data.max_prompt_length >= 1:
        need = cfg.data.max_prompt_length + cfg.generator.sampling.max_tokens
        if cfg.generator.max_turns == 1 and need > cfg.generator.max_model_len:
            c.problems.append(problem(
                "generator.max_model_len", cfg.generator.max_model_len,
                f"must be >= data.max_prompt_length + generator.sampling.max_tokens = {need}"))
    spec = cfg.generator.speculative_config
    if spec is not None:
        c.check("generator.speculative_config.num_speculative_tokens", lambda v: v is not None and v >= 1,
                "must be >= 1")

    # algorithm
    c.choice("algorithm.advantage_estimator", S.ADVANTAGE_ESTIMATORS)
    c.choice("algorithm.policy_loss_type", S.POLICY_LOSS_TYPES)
    c.choice("algorithm.loss_reduction", S.LOSS_REDUCTIONS)
    c.at_least("algorithm.eps_clip_low", 0.0)
    c.at_least("algorithm.eps_clip_high", 0.0)
    c.check("algorithm.dual_clip_c", lambda v: v is None or v > 1, "must be > 1 or null (off)")
    c.at_least("algorithm.dynamic_sampling.max_gen_rounds", 1)
    c.at_least("algorithm.overlong_punishment.buffer_len", 1)
    c.at_least("algorithm.overlong_punishment.penalty_factor", 0.0)

    # model
    if cfg.model.path is not None:
        c.existing_path("model.path")
        if Path(str(cfg.model.path)).is_dir() and not (Path(str(cfg.model.path)) / "config.json").exists():
            c.problems.append(problem("model.path", cfg.model.path, "directory has no config.json (expected an HF checkpoint)"))
    for key in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"):
        c.at_least(f"model.tiny.{key}", 1)
    c.at_least("model.tiny.mtp_layers", 0)

    # data
    c.choice("data.synthetic", S.SYNTHETIC_TASKS, optional=True)
    if cfg.data.synthetic is None and not cfg.data.train_files:
        c.problems.append(problem("data.train_files", [], "must list at least one parquet/JSONL file (or set data.synthetic)"))
    for i, path in enumerate(cfg.data.train_files):
        c.existing_path(f"data.train_files[{i}]", path)
    for i, path in enumerate(cfg.data.val_files):
        c.existing_path(f"data.val_files[{i}]", path)
    c.at_least("data.max_prompt_length", 1)
    c.at_least("data.synthetic_num_train", 1)
    c.at_least("data.synthetic_num_val", 1)
    c.at_least("data.synthetic_digits", 1)

    # environment
    c.choice("environment.name", S.ENVIRONMENTS)
    c.check("environment.math.timeout_s", lambda v: v > 0, "must be > 0")
    c.check("environment.search.timeout_s", lambda v: v > 0, "must be > 0")
    c.at_least("environment.search.topk", 1)
    c.at_least("environment.search.max_retries", 0)
    c.choice("environment.search.on_failure", ("score", "raise"))
    c.existing_path("environment.search.corpus_file")
    if cfg.environment.name == "search" and cfg.environment.search.retriever_url is None \
            and cfg.environment.search.corpus_file is None and cfg.data.synthetic != "search":
        c.problems.append(problem("environment.search.retriever_url", None,
                                  "the search environment needs a retriever_url or a corpus_file to serve locally"))
    pattern = cfg.environment.math.answer_pattern
    if pattern is not None:
        import re

        try:
            re.compile(pattern)
        except re.error as err:
            c.problems.append(problem("environment.math.answer_pattern", pattern, f"must be a valid regex ({err})"))

    # logger
    c.check("logger.backends", lambda v: all(b in S.LOGGER_BACKENDS for b in v),
            f"every entry must be one of {list(S.LOGGER_BACKENDS)}")
    c.choice("logger.wandb_mode", ("offline", "online", "disabled"))

    if c.problems:
        raise ConfigError(c.problems)
