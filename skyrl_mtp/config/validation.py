"""Semantic validation of a composed config, run once before any actor or engine starts.

Every check reports the full key, the offending value and what is allowed; all problems are
collected and raised together so a user fixes a recipe in one pass, one problem per key (a check
that depends on a key already reported is skipped, so one bad value is never reported twice).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from skyrl_mtp import allowed as A
from skyrl_mtp.config.checker import Checker
from skyrl_mtp.config.data_files import data_file_checks, data_source_checks
from skyrl_mtp.config.drafter_knob import drafter_checks
from skyrl_mtp.config.engine_kwargs import engine_kwargs_checks
from skyrl_mtp.config.model_dir import model_dir_checks
from skyrl_mtp.config.mtp_knob import mtp_checks
from skyrl_mtp.config.run_dir_check import run_dir_checks
from skyrl_mtp.errors import ConfigError, problem


def placement_checks(c: Checker) -> None:
    """The requested layout itself (no cluster needed): GPU/CPU consistency, GPUs per engine = TP x PP, colocation.

    Assumes the range checks of validate_config (counts >= 1, gpus >= 0) already hold.
    """
    cfg = c.cfg
    pl = cfg.trainer.placement
    engines = int(cfg.generator.num_engines)
    tp = int(cfg.generator.tensor_parallel_size) * int(cfg.generator.pipeline_parallel_size)   # workers per engine
    workers = int(pl.policy_num_workers)
    ge, gw = pl.gpus_per_engine, pl.gpus_per_policy_worker
    both = (f"engines and policy workers must both use GPUs or both use CPUs (gpus_per_engine={ge}, "
            f"gpus_per_policy_worker={gw}); the NCCL weight sync needs both on GPUs")
    c.check("trainer.placement.gpus_per_engine", lambda v: v > 0, both, when=gw > 0)
    c.check("trainer.placement.gpus_per_policy_worker", lambda v: v > 0, both, when=ge > 0)
    on_gpus = ge > 0 and gw > 0
    c.check("trainer.placement.gpus_per_engine", lambda v: v == tp,
            f"must equal generator.tensor_parallel_size * pipeline_parallel_size = {tp} (one GPU per worker of an "
            "engine), or 0 for CPU engines", when=on_gpus)
    c.check("trainer.placement.gpus_per_policy_worker", lambda v: v == 1,
            "must be 1 on GPUs (one Megatron rank per GPU), or 0 for CPU workers", when=on_gpus)
    c.check("trainer.placement.colocate", lambda v: not v or engines * tp == workers,
            f"needs generator.num_engines * tensor_parallel_size * pipeline_parallel_size = {engines}*{tp} = "
            f"{engines * tp} to equal trainer.placement.policy_num_workers = {workers} (each GPU "
            "hosts one policy rank and one engine rank); or set colocate=false for separate pools", when=on_gpus)


def placement_problems(cfg: DictConfig) -> list[str]:
    """Problems of the requested layout itself; empty when consistent."""
    c = Checker(cfg)
    placement_checks(c)
    return c.problems


# The rule of the model.tiny keys together: the tiny model's own rules, kept in one place with the model.
TINY_RULES = ("the tiny model's own rules (skyrl_mtp.models.tiny.spec_problems: sizes, a head size vLLM's CPU "
              "attention supports, divisibility, the heads each family supports)")


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


def pipeline_stage_checks(c: Checker) -> None:
    """The policy's pipeline stages hold equal shares of the decoder layers (megatron-core's default split;
    vLLM's engines split unevenly where they must)."""
    layers = _model_layers(c.cfg)
    pp = c.get("megatron.pp")
    c.rule("megatron.pp", "must divide the model's decoder layers (each pipeline stage of the policy holds an equal "
                          "share)")
    if layers is not None and isinstance(pp, int) and not isinstance(pp, bool) and pp > 1 and layers % pp:
        c.add("megatron.pp", pp, f"must divide the model's {layers} decoder layers (each pipeline stage of the "
                                 "policy holds an equal share)")


def async_rl_checks(c: Checker) -> None:
    """trainer.async_rl.*, and the settings the async modes cannot work with or have not been tested with yet."""
    c.choice("trainer.async_rl.mode", A.ASYNC_RL_MODES)
    cfg = c.cfg
    mode = cfg.trainer.async_rl.mode
    c.at_least("trainer.async_rl.max_staleness", 0)
    c.check("trainer.async_rl.max_staleness", lambda v: v == 1,
            f"is read only with trainer.async_rl.mode=fully_async (mode={mode!r}); leave it at 1",
            when=mode != "fully_async")
    on = mode in ("one_step_off", "fully_async")
    untested = f"with trainer.async_rl.mode={mode} (that combination is not tested yet)"
    c.check("trainer.placement.colocate", lambda v: not v,
            f"must be false with trainer.async_rl.mode={mode} (colocated engines sleep while the policy trains, "
            "so generation cannot overlap training)", when=on)
    c.check("trainer.mtp.num_speculative_tokens", lambda v: v != "auto", f"must be a fixed k {untested}",
            when=on and bool(cfg.trainer.mtp.enabled))
    c.check("generator.pipeline_parallel_size", lambda v: v == 1, f"must be 1 {untested}", when=on)
    c.check("generator.model_runner", lambda v: v == "v1", f"must be 'v1' {untested}", when=on)
    c.check("environment.name", lambda v: v == "math", f"must be 'math' {untested}", when=mode == "one_step_off")


def validate_config(cfg: DictConfig, *, check_memory: bool = True) -> None:
    """Raise ConfigError naming every invalid key of `cfg`, once each; `check_memory`: a GPU run must also fit its
    GPUs (config/memory_plan.py; `--cfg plan` prints the plan instead)."""
    placeholders = required_placeholders(cfg)
    if placeholders:     # the other checks would only add noise about the same placeholder paths
        raise ConfigError(placeholders)
    c = Checker(cfg)
    run_checks(c)
    if check_memory and not c.problems:   # the whole config is consistent: does a GPU run fit its GPUs?
        c.problems += memory_problems(cfg)
    if c.problems:
        raise ConfigError(c.problems)


def run_checks(c: Checker) -> None:
    """Every check of the config `c.cfg`: problems go to `c.problems`, the rules applied to `c.rules`."""
    cfg = c.cfg
    # trainer
    c.at_least("trainer.total_steps", 1)
    c.at_least("trainer.train_batch_size", 1)
    c.at_least("trainer.eval_every_n_steps", 0)
    c.at_least("trainer.eval_batch_size", 1)
    batch = cfg.trainer.train_batch_size
    c.check("trainer.policy_mini_batch_size", lambda v: v is None or 1 <= v <= batch,
            f"must be null or in [1, trainer.train_batch_size={batch}]")
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
    c.check("trainer.placement.gpu_memory_gb", lambda v: v > 0, "must be > 0 (GB of memory per GPU)")

    if not c.reported("trainer.placement"):
        placement_checks(c)   # GPU/CPU consistency, GPUs per engine = TP x PP, colocation shape
    c.choice("trainer.mtp.loss_type", A.DRAFT_LOSS_TYPES)
    c.at_least("trainer.mtp.loss_weight", 0.0)
    mtp_checks(c)
    drafter_checks(c)

    # megatron
    for key in ("tp", "pp", "cp", "dp", "micro_batch_size"):
        c.at_least(f"megatron.{key}", 1)
    c.check("megatron.cp", lambda v: v is None or v < 1 or v == 1,   # the policy worker has no cp yet
            "only 1 is supported: context parallelism is not implemented by the policy worker "
            "(scale with megatron.tp, megatron.pp and megatron.dp)")
    c.choice("megatron.dtype", A.DTYPES)
    c.choice("megatron.layer_impl", A.LAYER_IMPLS)
    c.at_least("megatron.ep", 1)
    c.at_least("megatron.moe_aux_loss_coeff", 0.0)
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
    c.check("megatron.ep", lambda v: (meg.tp * meg.dp) % v == 0,
            f"must divide megatron.tp * megatron.dp = {meg.tp * meg.dp} (megatron-core spreads the experts over groups "
            "of ep ranks of the tp * dp policy ranks)",
            when=min(meg.ep, meg.tp, meg.dp) >= 1 and not c.reported("megatron.ep", "megatron.tp", "megatron.dp"))
    layout = meg.tp * meg.pp * meg.cp * meg.dp
    # only when tp and dp are the sole unknowns: a bad pp / cp is reported once, under its own key
    c.check("trainer.placement.policy_num_workers", lambda v: v == layout,
            f"must equal the policy's parallel layout megatron.tp*pp*cp*dp = {meg.tp}*{meg.pp}*{meg.cp}*{meg.dp} "
            f"= {layout} (one worker per Megatron rank): a change of the layout changes both, e.g. "
            f"trainer.placement.policy_num_workers={layout} with megatron.tp={meg.tp}",
            when=min(meg.tp, meg.pp, meg.dp) >= 1 and meg.cp == 1
            and not c.reported("megatron.tp", "megatron.pp", "megatron.dp", "trainer.placement.policy_num_workers"))
    seqs = cfg.trainer.train_batch_size * max(cfg.generator.n_samples_per_prompt, 1)
    c.check("trainer.train_batch_size", lambda v: seqs % meg.dp == 0,
            f"train_batch_size * generator.n_samples_per_prompt = {seqs} sequences must be divisible by megatron.dp={meg.dp}",
            when=meg.dp >= 1 and cfg.trainer.train_batch_size >= 1
            and not c.reported("megatron.dp", "trainer.train_batch_size"))

    # generator
    c.choice("generator.backend", A.GENERATOR_BACKENDS)
    c.at_least("generator.num_engines", 1)
    c.at_least("generator.tensor_parallel_size", 1)
    c.at_least("generator.pipeline_parallel_size", 1)
    c.check("generator.pipeline_parallel_size", lambda v: not (isinstance(v, int) and not isinstance(v, bool) and v > 1),
            "must be 1 with trainer.mtp.num_speculative_tokens=auto (adaptive speculation chooses k in the engine's "
            "one worker; set a fixed k to draft under pipeline parallelism)",
            when=bool(cfg.trainer.mtp.enabled) and cfg.trainer.mtp.num_speculative_tokens == "auto")
    c.at_least("generator.n_samples_per_prompt", 1)
    c.check("generator.n_samples_per_prompt", lambda v: v >= 2,
            "must be >= 2 with algorithm.advantage_estimator=grpo (advantages are relative to the group of "
            "samples of the same prompt: a group of 1 has every advantage 0, so the policy never learns)",
            when=cfg.algorithm.advantage_estimator == "grpo")
    c.at_least("generator.max_turns", 1)
    c.at_least("generator.max_model_len", 16)
    c.at_least("generator.max_num_seqs", 1)
    c.at_least("generator.kv_cache_memory_mb", 1)
    c.choice("generator.dtype", A.DTYPES)
    c.choice("generator.model_runner", A.MODEL_RUNNERS)
    if cfg.generator.model_runner == "v2":
        if cfg.trainer.placement.gpus_per_engine == 0:
            c.add("generator.model_runner", "v2", "'v1' on CPU engines (trainer.placement.gpus_per_engine=0): vLLM's V2 "
                                                  "runner needs Triton on a GPU ('Model Runner V2 requires Triton')")
        elif cfg.trainer.mtp.num_speculative_tokens == "auto":
            c.add("generator.model_runner", "v2", "'v1' with trainer.mtp.num_speculative_tokens=auto: the adaptive-k "
                                                  "hook needs V1's propose_draft_token_ids and drafter")
    for which in ("sampling", "eval_sampling"):
        c.at_least(f"generator.{which}.temperature", 0.0)
        c.check(f"generator.{which}.top_p", lambda v: 0 < v <= 1, "must be in (0, 1]")
        c.check(f"generator.{which}.top_k", lambda v: v == -1 or v >= 1, "must be -1 (off) or >= 1")
        c.at_least(f"generator.{which}.max_tokens", 1)
    need = cfg.data.max_prompt_length + cfg.generator.sampling.max_tokens
    c.check("generator.max_model_len", lambda v: v >= need,
            f"must be >= data.max_prompt_length + generator.sampling.max_tokens = {need}",
            when=cfg.generator.sampling.max_tokens >= 1 and cfg.data.max_prompt_length >= 1
            and cfg.generator.max_turns == 1 and not c.reported("generator.max_model_len"))

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
    c.choice("algorithm.off_policy.correction", A.OFF_POLICY_CORRECTIONS)
    c.check("algorithm.off_policy.tis_cap", lambda v: v >= 1, "must be >= 1 (an on-policy token's weight is 1)")
    c.choice("algorithm.off_policy.tis_level", A.TIS_LEVELS)
    c.check("algorithm.off_policy.decoupled_weight_cap", lambda v: v is None or v > 1,
            "must be > 1 (an on-policy token's weight is 1) or null (no token left out)")

    # model
    c.existing_path("model.path")
    c.check("model.path", lambda v: not Path(str(v)).is_dir() or (Path(str(v)) / "config.json").exists(),
            "directory has no config.json (expected an HF checkpoint)", when=cfg.model.path is not None)
    if cfg.model.path is None:
        from dataclasses import asdict
        from types import SimpleNamespace

        from skyrl_mtp.models.tiny import TinyModelSpec, spec_problems

        # the tiny model's own rules, in one place: ranges, head_dim vLLM's CPU attention supports, divisibility
        fields = {k: v for k, v in OmegaConf.to_container(cfg.model.tiny, resolve=True).items() if k != "cache_dir"}
        c.rule("model.tiny", TINY_RULES)
        for name, allowed in spec_problems(SimpleNamespace(**{**asdict(TinyModelSpec()), **fields})):
            c.add(f"model.tiny.{name}", OmegaConf.select(cfg, f"model.tiny.{name}"), allowed)
    pipeline_stage_checks(c)
    family = model_dir_checks(c)   # the checkpoint's (or tiny model's) family, tokenizer, MTP layers and layout
    engine_kwargs_checks(c, family)

    # data
    c.choice("data.synthetic", A.SYNTHETIC_TASKS, optional=True)
    c.check("data.train_files", lambda v: len(v) > 0, "must list at least one parquet/JSONL file (or set data.synthetic)",
            when=cfg.data.synthetic is None)
    c.existing_paths("data.train_files")
    c.existing_paths("data.val_files")
    c.at_least("data.max_prompt_length", 1)
    c.at_least("data.synthetic_num_train", 1)
    c.at_least("data.synthetic_num_val", 1)
    c.at_least("data.synthetic_digits", 1)
    from skyrl_mtp.data.search_task import RELATION_NAMES

    c.check("data.synthetic_search_relations",
            lambda v: bool(v) and all(r in RELATION_NAMES for r in v) and len(set(v)) == len(v),
            f"a non-empty list of distinct names from {list(RELATION_NAMES)}")
    c.check("data.synthetic_search_warmstart_entities", lambda v: 0 <= v <= 20000, "an int in [0, 20000]")
    data_file_checks(c)

    # environment
    c.choice("environment.name", A.ENVIRONMENTS)
    data_source_checks(c)   # the environment and the warm start against where the prompts come from
    c.check("environment.math.timeout_s", lambda v: v > 0, "must be > 0")
    c.check("environment.search.timeout_s", lambda v: v > 0, "must be > 0")
    c.at_least("environment.search.topk", 1)
    c.at_least("environment.search.max_retries", 0)
    c.choice("environment.search.on_failure", A.SEARCH_ON_FAILURE)
    c.existing_path("environment.search.corpus_file")
    c.check("environment.search.retriever_url", lambda v: v is not None,
            "the search environment needs a retriever_url or a corpus_file to serve locally",
            when=cfg.environment.name == "search" and cfg.environment.search.corpus_file is None
            and cfg.data.synthetic != "search")
    c.rule("environment.math.answer_pattern", "must be a valid regex, or null")
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
    async_rl_checks(c)   # what trainer.async_rl.mode cannot work with (after each key's own checks)
    run_dir_checks(c)


def memory_problems(cfg: DictConfig) -> list[str]:
    """The memory plan's problems of a GPU run (none on CPU), or why it could not be made."""
    from skyrl_mtp.config.memory_plan import memory_plan, on_gpu, run_hf_config
    from skyrl_mtp.models.families import ModelBuildError

    if not on_gpu(cfg):
        return []
    where = "model.path" if cfg.model.path is not None else "model.tiny.family"
    try:
        plan = memory_plan(cfg, run_hf_config(cfg))
    except (OSError, ValueError, ModelBuildError) as err:
        return [problem(where, OmegaConf.select(cfg, where),
                        f"a model the trainer can build: the GPU memory plan reads its config.json ({err})")]
    return list(plan.problems)
