"""Typed schema of every run: the one place that says which keys exist, their types and defaults.

Hydra composes recipes and command-line overrides on top of `SkyRLConfig`; because the schema is a
structured config, an unknown key or a value of the wrong type is rejected at composition time.
Semantic checks (ranges, allowed names, contradictions, paths) live in `validation.py`, and the
derivation of low-level MTP settings from `trainer.mtp` lives in `mtp_knob.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from skyrl_mtp.allowed import (  # noqa: F401 - re-exported: the one allowed-values table
    ADVANTAGE_ESTIMATORS,
    DEFAULT_EXPLORE_BUDGET,
    DEFAULT_MTP_LOSS_CHUNK_SIZE,
    DRAFT_LOSS_TYPES,
    DTYPES,
    ENVIRONMENTS,
    GENERATOR_BACKENDS,
    LOGGER_BACKENDS,
    LOSS_REDUCTIONS,
    LR_SCHEDULES,
    POLICY_LOSS_TYPES,
    RESUME_MODES,
    SYNTHETIC_TASKS,
)


@dataclass
class MTPConfig:
    """The one high-level MTP knob: drafting at inference and head training at train time."""

    enabled: bool = True
    # an int k >= 1 (k drafts every engine step), or "auto": k is chosen per engine step between 0 and
    # max_speculative_tokens from the running batch, live acceptance and timings measured on the engine
    num_speculative_tokens: int | str = 2
    max_speculative_tokens: int = 3   # the maximum k when num_speculative_tokens=auto (ignored otherwise)
    # how the head drafts in vLLM: "greedy" (argmax; acceptance <= p_target(argmax) at T=1) or
    # "probabilistic" (sampled from the head's distribution; pairs with loss_type=tv). Probabilistic
    # drafts use vLLM's rejection-sampling coupling (lossless in distribution, tokens depend on drafts).
    draft_sample_method: str = "greedy"
    # the cheaper draft loss: train on about this fraction of each sequence's draft positions (1.0 = all)
    loss_position_fraction: float = 1.0
    # depth d's draft loss weighs loss_depth_decay ** (d - 1) (1.0: every depth alike). A draft at depth d
    # is verified only when depths 1..d-1 were accepted, so the deeper ones may deserve less weight;
    # measured both ways (README): 1.0 drafts better on the default run, 0.5 on a trigram target.
    loss_depth_decay: float = 1.0
    loss_type: str = "soft_ce"
    loss_weight: float = 1.0
    # false: train the head but roll out without speculative decoding (e.g. to warm the head up
    # before drafting with it). Bitwise comparisons do not need it on CPU: with
    # generator.draft_invariant_sampling seeded rollouts are a function of the policy alone anyway.
    draft_in_rollouts: bool = True
    # Draft depths the head is trained on (depth d predicts token t+d from the head's own depth d-1
    # output; depths beyond the checkpoint's MTP layers reuse the last layer, as vLLM drafts with it).
    # null = num_speculative_tokens, i.e. trained for every depth it drafts; under
    # num_speculative_tokens=auto, each step trains the depths the engines drafted in >= 10% of the
    # rollout's engine steps plus one more (at most max_speculative_tokens; mtp/draft_depths.py).
    train_depths: int | None = None
    # num_speculative_tokens=auto with train_depths=null: the head trains on a step when its credit covers
    # what its last training took (training it and pushing it to the engines): the engine time its drafts
    # saved since, plus this share of each step's time (that aside) for keeping it aligned with the policy
    # while drafting saves nothing
    # (mtp/draft_depths.py). So an idle head costs at most this share of the run, on any model.
    idle_head_train_budget: float = 0.01
    # num_speculative_tokens=auto: the share of the engines' time the choice of k may spend exploring (probes
    # of other ks, challenges of a k that may be better, timing each new batch size at every k), charged at
    # what each exploration is predicted to cost beyond the best k (rollout/adaptive_speculation.py). It is
    # what lets the engines notice a head that got better; 0 explores only where that is predicted free.
    explore_budget: float = DEFAULT_EXPLORE_BUDGET
    # num_speculative_tokens=auto: a directory where every engine core writes each call its scheduler makes to
    # the policy choosing k (one file per engine process, rollout/policy_trace.py), for an exact replay of
    # its choices (benchmarks/speculation_policy_trace.py); null writes nothing
    policy_trace_dir: str | None = None


@dataclass
class PlacementConfig:
    colocate: bool = False
    policy_num_workers: int = 1
    cpus_per_policy_worker: int = 1
    cpus_per_engine: int = 1
    gpus_per_policy_worker: int = 0
    gpus_per_engine: int = 0


@dataclass
class CheckpointConfig:
    every_n_steps: int = 0
    keep_last: int = 2
    export_hf: bool = True
    export_draft_head: bool = True


@dataclass
class WarmStartConfig:
    """Supervised warm start of a tiny policy (the embedded default); cached on disk."""

    enabled: bool = False
    steps: int = 200
    lr: float = 3e-3
    batch_size: int = 32
    cache_dir: str | None = None


@dataclass
class TrainerConfig:
    seed: int = 42
    total_steps: int = 10
    train_batch_size: int = 8
    # Prompts per optimizer step: the step's batch is split into mini-batches, each one update of the
    # policy and the head (old logprobs are computed once, before the first). None = one update per step.
    policy_mini_batch_size: int | None = None
    eval_every_n_steps: int = 0
    eval_batch_size: int = 16
    run_dir: str = "runs/default"
    resume: str = "auto"
    progress_bar: bool = True
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)


@dataclass
class OptimizerConfig:
    """AdamW of the policy or of the MTP head (each has its own). The LR rises linearly over
    `warmup_steps` optimizer steps, then follows `lr_schedule`: constant, or linear / cosine decay to 0
    at the run's last optimizer step (trainer.total_steps x updates per step)."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    grad_clip: float = 1.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0


@dataclass
class MegatronConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    # expert parallel size for mixture-of-experts models: the routed experts are spread over groups of ep
    # ranks (each holds n_experts / ep of them); ep divides tp * dp. Dense models: 1.
    ep: int = 1
    # > 0: megatron-core's sequence-level router load-balancing loss (DeepSeek-V3's) at this coefficient, on
    # the trunk's routers (part of the policy update) and the MTP layers' (part of the draft loss only)
    moe_aux_loss_coeff: float = 0.0
    micro_batch_size: int = 4
    dtype: str = "float32"
    # MTP layers built into the policy; null = the checkpoint's num_nextn_predict_layers.
    # The draft-loss type and weight are trainer.mtp.loss_type / loss_weight (one key per thing).
    mtp_num_layers: int | None = None
    mtp_loss_topk: int = 32                                     # for trainer.mtp.loss_type=topk_soft_ce
    # tokens per chunk of the draft loss; 0 = one chunk; auto = a chunk's logits at 2**27 elements of the vocab shard
    mtp_loss_chunk_size: int | str = DEFAULT_MTP_LOSS_CHUNK_SIZE
    policy_optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    head_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-4))


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)


@dataclass
class GeneratorConfig:
    backend: str = "vllm"
    num_engines: int = 1
    tensor_parallel_size: int = 1
    # vLLM pipeline parallelism inside each engine (engines too large for one node's TP); see validation.py
    pipeline_parallel_size: int = 1
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eval_sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0))
    n_samples_per_prompt: int = 4
    max_turns: int = 1
    max_model_len: int = 1024
    max_num_seqs: int = 64
    kv_cache_memory_mb: int = 256
    enforce_eager: bool = True
    dtype: str = "float32"
    cpu_sampling_fix: bool = True
    # CPU: a request's t-th token is sampled with noise keyed to t, whatever was drafted, so seeded
    # rollouts do not depend on the MTP head (acceptance law unchanged). See rollout/draft_invariant_sampling.py.
    draft_invariant_sampling: bool = True
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class DynamicSamplingConfig:
    enabled: bool = True
    max_gen_rounds: int = 3


@dataclass
class OverlongPunishmentConfig:
    enabled: bool = False
    buffer_len: int = 64
    penalty_factor: float = 1.0


@dataclass
class AlgorithmConfig:
    advantage_estimator: str = "grpo"
    norm_adv_by_std: bool = True
    policy_loss_type: str = "dapo"
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    dual_clip_c: float | None = None
    loss_reduction: str = "token_mean"
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong_filtering: bool = False
    overlong_punishment: OverlongPunishmentConfig = field(default_factory=OverlongPunishmentConfig)


@dataclass
class TinyModelConfig:
    """Build the embedded tiny model when `model.path` is null (architecture: `family`)."""

    family: str = "mimo"  # model family of the tiny model: "mimo", "qwen3_5" (hybrid Gated DeltaNet), "deepseek_v3" (MLA + MoE)
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 512
    mtp_layers: int = 1
    seed: int = 0
    cache_dir: str | None = None


@dataclass
class ModelConfig:
    path: str | None = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    # When set, the task's data is generated locally instead of read from train_files.
    synthetic: str | None = None
    synthetic_num_train: int = 2000
    synthetic_num_val: int = 64
    # operand digits of the synthetic arithmetic task
    synthetic_digits: int = 2
    # synthetic search task: which relations are asked, and how many entities of their own the warm-start
    # traces use (0: the traces answer the train questions; > 0: no RL or eval answer is ever trained on)
    synthetic_search_relations: list[str] = field(default_factory=lambda: ["capital", "founder", "river", "currency"])
    synthetic_search_warmstart_entities: int = 0
    synthetic_dir: str | None = None
    max_prompt_length: int = 256
    shuffle: bool = True
    skip_malformed: bool = False


@dataclass
class MathEnvConfig:
    answer_pattern: str | None = None
    timeout_s: float = 5.0


@dataclass
class SearchEnvConfig:
    retriever_url: str | None = None
    corpus_file: str | None = None
    topk: int = 3
    timeout_s: float = 5.0
    max_retries: int = 2
    on_failure: str = "score"


@dataclass
class EnvironmentConfig:
    name: str = "math"
    math: MathEnvConfig = field(default_factory=MathEnvConfig)
    search: SearchEnvConfig = field(default_factory=SearchEnvConfig)


@dataclass
class LoggerConfig:
    backends: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    project: str = "skyrl-mtp"
    run_name: str = "default"
    wandb_mode: str = "offline"
    plots: bool = True
    # false: vLLM / Megatron / Ray log at WARNING and known harmless warnings are hidden
    verbose: bool = False


@dataclass
class SkyRLConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
