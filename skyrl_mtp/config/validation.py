"""Semantic validation of a composed config, run once before any actor or engine starts.

Every check reports the full key, the offending value and what is allowed; all problems are
collected and raised together so a user fixes a recipe in one pass, one problem per key (a check
that depends on a key already reported is skipped, so one bad value is never reported twice).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from skyrl_mtp import allowed as A
from skyrl_mtp.config.errors import ConfigError, problem
from skyrl_mtp.config.mtp_knob import mtp_problems


class _Checker:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.problems: list[str] = []

    def get(self, key: str) -> Any:
        return OmegaConf.select(self.cfg, key)

    def add(self, key: str, value: Any, allowed: str) -> None:
        """Record a problem of `key` unless one is already recorded for it."""
        if not self.reported(key):
            self.problems.append(problem(key, value, allowed))

    def reported(self, *keys: str) -> bool:
        return any(p.startswith(f"{k}=") or p.startswith(f"{k}[") for p in self.problems for k in keys)

    def check(self, key: str, ok: Callable[[Any], bool], allowed: str) -> None:
        value = self.get(key)
        if not ok(value):
            self.add(key, value, allowed)

    def choice(self, key: str, choices: tuple[str, ...], optional: bool = False) -> None:
        self.check(key, lambda v: (optional and v is None) or v in choices,
                   f"must be one of {list(choices)}" + (" or null" if optional else ""))

    def at_least(self, key: str, low: float, optional: bool = False) -> None:
        self.check(key, lambda v: (optional and v is None) or (v is not None and v >= low),
                   f"must be >= {low}" + (" or null" if optional else ""))

    def existing_path(self, key: str, value: Any = None) -> None:
        value = self.get(key) if value is None else value
        if value is not None and not Path(str(value)).exists():
            self.add(key, value, "path does not exist")


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


def _model_layers(cfg: DictConfig) -> int | None:
    """Decoder layers of the model the run trains and serves (the tiny spec's, or the checkpoint's), if known."""
    if cfg.model.path is None:
        layers = cfg.model.tiny.layers
        return layers if isinstance(layers, int) and layers >= 1 else None
    config = Path(str(cfg.model.path)) / "config.json"
    if not config.is_file():
        return None
    import json

    hf = json.loads(config.read_text())
    layers = hf.get("num_hidden_layers", hf.get("text_config", {}).get("num_hidden_layers"))
    return layers if isinstance(layers, int) else None


def _pipeline_stages_divide_the_layers(c: _Checker, cfg: DictConfig) -> None:
    """The policy's pipeline stages hold equal shares of the decoder layers (megatron-core's default split;
    vLLM's engines split unevenly where they must)."""
    layers = _model_layers(cfg)
    pp = c.get("megatron.pp")
    if layers is not None and isinstance(pp, int) and not isinstance(pp, bool) and pp > 1 and layers % pp:
        c.add("megatron.pp", pp, f"must divide the model's {layers} decoder layers (each pipeline stage of the "
                                 "policy holds an equal share)")


def validate_config(cfg: DictConfig) -> None:
    """Raise ConfigError naming every invalid key of `cfg`, once each."""
    placeholders = required_placeholders(cfg)
    if placeholders:     # the other checks would only add noise about the same placeholder paths
        raise ConfigError(placeholders)
    c = _Checker(cfg)

    # trainer
    c.at_least("trainer.total_steps", 1)
    c.at_least("trainer.train_batch_size", 1)
    c.at_least("trainer.eval_every_n_steps", 0)
    c.at_least("trainer.eval_batch_size", 1)
    mini = cfg.trainer.policy_mini_batch_size
    if mini is not None and not (1 <= mini <= cfg.trainer.train_batch_size):
        c.add("trainer.policy_mini_batch_size", mini,
                                  f"must be null or in [1, trainer.train_batch_size={cfg.trainer.train_batch_size}]")
    c.choice("trainer.resume", A.RESUME_MODES)
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

    if not c.reported("trainer.placement"):
        c.problems += placement_problems(cfg)   # GPU/CPU consistency, GPUs per engine = TP, colocation shape
    c.choice("trainer.mtp.loss_type", A.DRAFT_LOSS_TYPES)
    c.at_least("trainer.mtp.loss_weight", 0.0)
    c.problems += [p for p in mtp_problems(cfg) if not c.reported(p.split("=", 1)[0])]

    # megatron
    for key in ("tp", "pp", "cp", "dp", "micro_batch_size"):
        c.at_least(f"megatron.{key}", 1)
    c.check("megatron.cp", lambda v: v is None or v < 1 or v == 1,   # the policy worker has no cp yet
            "only 1 is supported: context parallelism is not implemented by the policy worker "
            "(scale with megatron.tp, megatron.pp and megatron.dp)")
    c.choice("megatron.dtype", A.DTYPES)
    c.at_least("megatron.mtp_num_layers", 0, optional=True)
    c.at_least("megatron.mtp_loss_topk", 1)
    c.check("megatron.mtp_loss_chunk_size", A.is_chunk_size, f"must be {A.MTP_LOSS_CHUNK_SIZE_ALLOWED}")
    for opt in ("policy_optimizer", "head_optimizer"):
        c.check(f"megatron.{opt}.lr", lambda v: v >= 0, "must be >= 0")
        c.at_least(f"megatron.{opt}.weight_decay", 0.0)
        c.check(f"megatron.{opt}.grad_clip", lambda v: v > 0, "must be > 0")
        c.check(f"megatron.{opt}.eps", lambda v: v > 0, "must be > 0")
        c.check(f"megatron.{opt}.betas", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
                "must be two numbers in [0, 1)")
        c.choice(f"megatron.{opt}.lr_schedule", A.LR_SCHEDULES)
        c.at_least(f"megatron.{opt}.warmup_steps", 0)
    meg = cfg.megatron
    world = cfg.trainer.placement.policy_num_workers
    layout = meg.tp * meg.pp * meg.cp * meg.dp
    # only when tp and dp are the sole unknowns: a bad pp / cp is reported once, under its own key
    if min(meg.tp, meg.pp, meg.dp) >= 1 and meg.cp == 1 and layout != world \
            and not c.reported("megatron.tp", "megatron.pp", "megatron.dp", "trainer.placement.policy_num_workers"):
        c.add("trainer.placement.policy_num_workers", world,
              f"must equal the policy's parallel layout megatron.tp*pp*cp*dp = {meg.tp}*{meg.pp}*{meg.cp}*{meg.dp} "
              f"= {layout} (one worker per Megatron rank)")
    if meg.dp >= 1 and cfg.trainer.train_batch_size >= 1 and not c.reported("megatron.dp", "trainer.train_batch_size"):
        seqs = cfg.trainer.train_batch_size * max(cfg.generator.n_samples_per_prompt, 1)
        if seqs % meg.dp != 0:
            c.add(
                "trainer.train_batch_size", cfg.trainer.train_batch_size,
                f"train_batch_size * generator.n_samples_per_prompt = {seqs} sequences must be divisible by megatron.dp={meg.dp}")

    # generator
    c.choice("generator.backend", A.GENERATOR_BACKENDS)
    c.at_least("generator.num_engines", 1)
    c.at_least("generator.tensor_parallel_size", 1)
    c.at_least("generator.pipeline_parallel_size", 1)
    pp = cfg.generator.pipeline_parallel_size
    if isinstance(pp, int) and not isinstance(pp, bool) and pp > 1 and cfg.trainer.mtp.enabled \
            and cfg.trainer.mtp.num_speculative_tokens == "auto":
        c.add("generator.pipeline_parallel_size", pp,
              "must be 1 with trainer.mtp.num_speculative_tokens=auto (adaptive speculation chooses k in the "
              "engine's one worker; set a fixed k to draft under pipeline parallelism)")
    c.at_least("generator.n_samples_per_prompt", 1)
    if cfg.algorithm.advantage_estimator == "grpo":
        c.check("generator.n_samples_per_prompt", lambda v: v >= 2,
                "must be >= 2 with algorithm.advantage_estimator=grpo (advantages are relative to the group of "
                "samples of the same prompt: a group of 1 has every advantage 0, so the policy never learns)")
    c.at_least("generator.max_turns", 1)
    c.at_least("generator.max_model_len", 16)
    c.at_least("generator.max_num_seqs", 1)
    c.at_least("generator.kv_cache_memory_mb", 1)
    c.choice("generator.dtype", A.DTYPES)
    for which in ("sampling", "eval_sampling"):
        c.at_least(f"generator.{which}.temperature", 0.0)
        c.check(f"generator.{which}.top_p", lambda v: 0 < v <= 1, "must be in (0, 1]")
        c.check(f"generator.{which}.top_k", lambda v: v == -1 or v >= 1, "must be -1 (off) or >= 1")
        c.at_least(f"generator.{which}.max_tokens", 1)
    if cfg.generator.sampling.max_tokens >= 1 and cfg.data.max_prompt_length >= 1 \
            and not c.reported("generator.max_model_len"):
        need = cfg.data.max_prompt_length + cfg.generator.sampling.max_tokens
        if cfg.generator.max_turns == 1 and need > cfg.generator.max_model_len:
            c.add(
                "generator.max_model_len", cfg.generator.max_model_len,
                f"must be >= data.max_prompt_length + generator.sampling.max_tokens = {need}")

    # algorithm
    c.choice("algorithm.advantage_estimator", A.ADVANTAGE_ESTIMATORS)
    c.choice("algorithm.policy_loss_type", A.POLICY_LOSS_TYPES)
    c.choice("algorithm.loss_reduction", A.LOSS_REDUCTIONS)
    c.check("algorithm.eps_clip_low", lambda v: 0 < v < 1,
            "must be in (0, 1): the ratio is clipped to [1 - eps_clip_low, 1 + eps_clip_high]")
    c.check("algorithm.eps_clip_high", lambda v: v > 0,
            "must be > 0: the ratio is clipped to [1 - eps_clip_low, 1 + eps_clip_high]")
    c.check("algorithm.dual_clip_c", lambda v: v is None or v > 1, "must be > 1 or null (off)")
    c.at_least("algorithm.dynamic_sampling.max_gen_rounds", 1)
    c.at_least("algorithm.overlong_punishment.buffer_len", 1)
    c.at_least("algorithm.overlong_punishment.penalty_factor", 0.0)

    # model
    if cfg.model.path is not None:
        c.existing_path("model.path")
        if Path(str(cfg.model.path)).is_dir() and not (Path(str(cfg.model.path)) / "config.json").exists():
            c.add("model.path", cfg.model.path, "directory has no config.json (expected an HF checkpoint)")
    for key in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"):
        c.at_least(f"model.tiny.{key}", 1)
    c.at_least("model.tiny.mtp_layers", 0)
    if cfg.model.path is None and not c.reported("model.tiny"):
        import re

        from skyrl_mtp.config.build import model_source

        try:   # the tiny model's own shape rules (head_dim vLLM's CPU attention supports, divisibility)
            model_source(cfg)
        except ValueError as err:
            m = re.match(r"TinyModelSpec\.(\w+)=(\S+) is invalid[:;]? ?(?:allowed: )?(.*)", str(err))
            if m is None:
                raise
            c.add(f"model.tiny.{m.group(1)}", OmegaConf.select(cfg, f"model.tiny.{m.group(1)}"), m.group(3))
    from skyrl_mtp.models.tiny import FAMILIES as TINY_FAMILIES

    c.choice("model.tiny.family", TINY_FAMILIES)
    _pipeline_stages_divide_the_layers(c, cfg)

    # data
    c.choice("data.synthetic", A.SYNTHETIC_TASKS, optional=True)
    if cfg.data.synthetic is None and not cfg.data.train_files:
        c.add("data.train_files", [], "must list at least one parquet/JSONL file (or set data.synthetic)")
    for i, path in enumerate(cfg.data.train_files):
        c.existing_path(f"data.train_files[{i}]", path)
    for i, path in enumerate(cfg.data.val_files):
        c.existing_path(f"data.val_files[{i}]", path)
    c.at_least("data.max_prompt_length", 1)
    c.at_least("data.synthetic_num_train", 1)
    c.at_least("data.synthetic_num_val", 1)
    c.at_least("data.synthetic_digits", 1)
    from skyrl_mtp.data.search_task import RELATION_NAMES

    rels = list(cfg.data.synthetic_search_relations)
    if not rels or any(r not in RELATION_NAMES for r in rels) or len(set(rels)) != len(rels):
        c.add("data.synthetic_search_relations", rels, f"a non-empty list of distinct names from {list(RELATION_NAMES)}")
    c.check("data.synthetic_search_warmstart_entities", lambda v: 0 <= v <= 20000, "an int in [0, 20000]")

    # environment
    c.choice("environment.name", A.ENVIRONMENTS)
    c.check("environment.math.timeout_s", lambda v: v > 0, "must be > 0")
    c.check("environment.search.timeout_s", lambda v: v > 0, "must be > 0")
    c.at_least("environment.search.topk", 1)
    c.at_least("environment.search.max_retries", 0)
    c.choice("environment.search.on_failure", A.SEARCH_ON_FAILURE)
    c.existing_path("environment.search.corpus_file")
    if cfg.environment.name == "search" and cfg.environment.search.retriever_url is None \
            and cfg.environment.search.corpus_file is None and cfg.data.synthetic != "search":
        c.add("environment.search.retriever_url", None,
                                  "the search environment needs a retriever_url or a corpus_file to serve locally")
    pattern = cfg.environment.math.answer_pattern
    if pattern is not None:
        import re

        try:
            re.compile(pattern)
        except re.error as err:
            c.add("environment.math.answer_pattern", pattern, f"must be a valid regex ({err})")

    # logger
    c.check("logger.backends", lambda v: all(b in A.LOGGER_BACKENDS for b in v),
            f"every entry must be one of {list(A.LOGGER_BACKENDS)}")
    c.choice("logger.wandb_mode", A.WANDB_MODES)

    if c.problems:
        raise ConfigError(c.problems)
