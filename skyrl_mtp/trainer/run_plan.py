"""The run plan: a validated config turned, once, into the frozen settings of every component.

`build_run_plan(cfg)` is the only place that maps the user's keys (`trainer.*`, `megatron.*`,
`generator.*`, ...) to the fields of the objects the components take: the policy workers
(`PolicyWorkerConfig`), the inference engines (`EngineConfig`), the RL loop (`LoopConfig`), the
environment, the data, the model, the warm start, the placement plan and the tracker. The launcher and
the trainer take the plan and never read the config, so `tests/unit/config/test_every_key_reaches_a_component.py`
can prove, key by key, that changing a key changes what a component receives. One function per
component below builds its part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from skyrl_mtp.config.memory_plan import MemoryPlan, run_memory_plan
from skyrl_mtp.config.mtp_knob import (  # noqa: F401 - the derived MTP settings, part of the plan's vocabulary
    adaptive_speculation,
    max_speculative_tokens,
    rollout_speculative_tokens,
    train_depths,
)

# ---------------------------------------------------------------------------------------------- policy

def updates_per_step(cfg: DictConfig) -> int:
    """Optimizer steps per RL step: one per mini-batch of trainer.policy_mini_batch_size prompts."""
    batch = int(cfg.trainer.train_batch_size)
    return math.ceil(batch / int(cfg.trainer.policy_mini_batch_size or batch))


def policy_worker_config(cfg: DictConfig, memory: MemoryPlan | None = None):
    """The Megatron policy workers' config of the RL run (policy + MTP head, both optimizers); `model_path`: the
    checkpoint they load (its config.json sizes the memory plan; default: model.path or the tiny model)."""
    from skyrl_mtp.policy.config import PolicyWorkerConfig

    m, mtp = cfg.megatron, cfg.trainer.mtp
    po, ho = m.policy_optimizer, m.head_optimizer
    external = external_drafter(cfg)
    enabled = bool(mtp.enabled) and external is None   # the model's own MTP layers
    return PolicyWorkerConfig(
        tp=int(m.tp), pp=int(m.pp), dp=int(m.dp), ep=int(m.ep), moe_aux_loss_coeff=float(m.moe_aux_loss_coeff),
        draft_runner=str(cfg.generator.model_runner),
        mtp_enabled=enabled, drafter_kind=external or "mtp",
        drafter_init=cfg.trainer.drafter.init if external else None,
        drafter_layer_ids=tuple(cfg.trainer.drafter.layer_ids) if external and cfg.trainer.drafter.layer_ids else None,
        **_dflash_fields(cfg, external),
        mtp_num_layers=(m.mtp_num_layers if enabled else 0), mtp_num_depths=train_depths(cfg),
        mtp_loss_type=str(mtp.loss_type), mtp_loss_weight=float(mtp.loss_weight) if mtp.enabled else 0.0,
        mtp_loss_topk=int(m.mtp_loss_topk), mtp_loss_chunk_size=m.mtp_loss_chunk_size,
        mtp_loss_position_fraction=float(mtp.loss_position_fraction),
        mtp_loss_depth_decay=float(mtp.loss_depth_decay),
        policy_lr=float(po.lr), weight_decay=float(po.weight_decay), betas=tuple(po.betas), eps=float(po.eps),
        policy_grad_clip=float(po.grad_clip), lr_warmup_steps=int(po.warmup_steps), lr_schedule=str(po.lr_schedule),
        head_lr=float(ho.lr), head_weight_decay=float(ho.weight_decay), head_betas=tuple(ho.betas),
        head_eps=float(ho.eps), head_grad_clip=float(ho.grad_clip), head_lr_warmup_steps=int(ho.warmup_steps),
        head_lr_schedule=str(ho.lr_schedule),
        lr_decay_steps=int(cfg.trainer.total_steps) * updates_per_step(cfg),
        export_hf=bool(cfg.trainer.checkpoint.export_hf), export_draft_head=bool(cfg.trainer.checkpoint.export_draft_head),
        micro_batch_size=int(m.micro_batch_size), seed=int(cfg.trainer.seed), dtype=str(m.dtype),
        recompute_activations=bool(m.recompute_activations), layer_impl=str(m.layer_impl),
        **_gpu_policy_fields(cfg, memory))


def external_drafter(cfg: DictConfig) -> str | None:
    """The kind of the drafter trained beside the policy (trainer.drafter.kind other than mtp) when the engines
    speculate; None: the model's own MTP layers, or no speculation."""
    kind = str(cfg.trainer.drafter.kind)
    return kind if kind != "mtp" and bool(cfg.trainer.mtp.enabled) else None


def _dflash_fields(cfg: DictConfig, external: str | None) -> dict[str, Any]:
    """A DFlash drafter's settings: its layers, block (null: k + 1, one block per engine step), anchors, mask token."""
    if external != "dflash":
        return {}
    d = cfg.trainer.drafter
    return {"drafter_num_layers": int(d.num_layers),
            "drafter_block_size": int(d.block_size) if d.block_size is not None else max_speculative_tokens(cfg) + 1,
            "drafter_anchors": int(d.anchors), "drafter_mask_token_id": d.mask_token_id}


def _gpu_policy_fields(cfg: DictConfig, memory: MemoryPlan | None) -> dict[str, Any]:
    """What the memory plan decides for the policy on GPUs (nothing on CPU): whether grads and optimizer state leave
    the GPU while colocated engines are awake."""
    plan = run_memory_plan(cfg) if memory is None else memory
    if plan is None or plan.device != "gpu":
        return {}
    return {"offload_while_engines_awake": plan.offload_while_engines_awake}


def warm_start_worker_config(cfg: DictConfig):
    """The single policy worker of the supervised warm start: the trunk only (no head), its own constant LR."""
    from skyrl_mtp.policy.config import PolicyWorkerConfig

    m = cfg.megatron
    return PolicyWorkerConfig(tp=1, pp=1, dp=1, mtp_enabled=False, mtp_num_layers=0, mtp_loss_weight=0.0,
                              policy_lr=float(cfg.trainer.warm_start.lr), policy_grad_clip=1.0,
                              micro_batch_size=int(m.micro_batch_size), seed=int(cfg.trainer.seed), dtype=str(m.dtype))


@dataclass(frozen=True)
class WarmStartSettings:
    enabled: bool
    plan: Any                 # skyrl_mtp.trainer.warm_start.WarmStartPlan (part of the cache key)
    cache_dir: str | None     # None: <cache>/warm_start


def warm_start_settings(cfg: DictConfig) -> WarmStartSettings:
    from skyrl_mtp.trainer.warm_start import WarmStartPlan

    ws = cfg.trainer.warm_start
    plan = WarmStartPlan(steps=int(ws.steps), lr=float(ws.lr), batch_size=int(ws.batch_size), seed=int(cfg.trainer.seed),
                         micro_batch_size=int(cfg.megatron.micro_batch_size))
    return WarmStartSettings(bool(ws.enabled), plan, ws.cache_dir)


# ---------------------------------------------------------------------------------------------- engines

def weight_transfer_backend(cfg: DictConfig) -> str:
    """The weight transport (weight_sync/transport.py): engines on GPUs of their own -> nccl,
    sharing the policy's GPUs -> ipc, CPU -> skyrl_cpu."""
    from skyrl_mtp.weight_sync.transport import choose_backend

    pl = cfg.trainer.placement
    on_gpu = int(pl.gpus_per_engine) > 0
    return choose_backend(on_gpu, bool(on_gpu and pl.colocate))


def engine_config(cfg: DictConfig, model_path: str | Path, memory: MemoryPlan | None = None):
    """The vLLM engines' config; speculative decoding is derived from trainer.mtp only."""
    from skyrl_mtp.rollout.config import EngineConfig

    g = cfg.generator
    return EngineConfig(
        model_path=str(model_path), num_engines=int(g.num_engines), tensor_parallel_size=int(g.tensor_parallel_size),
        pipeline_parallel_size=int(g.pipeline_parallel_size), weight_transfer_backend=weight_transfer_backend(cfg),
        num_speculative_tokens=rollout_speculative_tokens(cfg), max_model_len=int(g.max_model_len),
        max_num_seqs=int(g.max_num_seqs), kv_cache_memory_bytes=int(g.kv_cache_memory_mb) * 2**20,
        enforce_eager=bool(g.enforce_eager), dtype=str(g.dtype), seed=int(cfg.trainer.seed),
        cpu_sampling_fix=bool(g.cpu_sampling_fix), draft_invariant_sampling=bool(g.draft_invariant_sampling),
        model_runner=str(g.model_runner),
        adaptive_speculation=adaptive_speculation(cfg) and rollout_speculative_tokens(cfg) > 0,
        draft_sample_method=str(cfg.trainer.mtp.draft_sample_method),
        explore_budget=float(cfg.trainer.mtp.explore_budget),
        policy_trace_dir=cfg.trainer.mtp.policy_trace_dir,
        # logger.verbose=false: no progress bars of vLLM's checkpoint loading on the console; on GPUs the memory
        # plan's gpu_memory_utilization (vLLM refuses to start a colocated engine at its 0.92 default)
        engine_kwargs={**({} if cfg.logger.verbose else {"use_tqdm_on_load": False}),
                       **_gpu_engine_kwargs(cfg, memory),
                       **OmegaConf.to_container(g.engine_kwargs, resolve=True)})


def _gpu_engine_kwargs(cfg: DictConfig, memory: MemoryPlan | None) -> dict[str, Any]:
    plan = run_memory_plan(cfg) if memory is None else memory
    if plan is None or plan.device != "gpu" or int(cfg.trainer.placement.gpus_per_engine) == 0:
        return {}
    return {"gpu_memory_utilization": plan.gpu_memory_utilization}


# ---------------------------------------------------------------------------------------------- RL loop

@dataclass(frozen=True)
class SamplingSettings:
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: tuple[str, ...]


def _sampling(sc: Any) -> SamplingSettings:
    return SamplingSettings(float(sc.temperature), float(sc.top_p), int(sc.top_k), int(sc.max_tokens), tuple(sc.stop))


@dataclass(frozen=True)
class LoopConfig:
    """What `RLTrainer` reads: the step loop, rollouts, advantages, the policy loss, eval and checkpoints."""

    seed: int
    total_steps: int
    train_batch_size: int
    mini_batch_size: int | None
    shuffle: bool
    n_samples_per_prompt: int
    sampling: SamplingSettings
    eval_sampling: SamplingSettings
    eval_every_n_steps: int
    eval_batch_size: int
    dynamic_sampling: bool
    max_gen_rounds: int
    norm_adv_by_std: bool
    loss_kwargs: tuple[tuple[str, Any], ...]     # of the DAPO/PPO policy loss (a tuple: frozen, hashable)
    overlong_filtering: bool
    overlong_punishment: tuple[bool, int, float]  # (enabled, buffer_len, penalty_factor)
    dp: int
    checkpoint_every_n_steps: int
    keep_last: int
    resume: str
    progress_bar: bool
    run_dir: str
    # trainer.mtp.train_depths=null under num_speculative_tokens=auto: each step's head training covers the
    # depths the engines drafted (mtp/draft_depths.py), at most `head_max_depths`; otherwise None
    head_max_depths: int | None = None
    # with head_max_depths: the share of each step's time allowed for keeping an idle head aligned
    idle_head_train_budget: float = 1.0
    num_engines: int = 1             # engines run side by side (their drafting savings are averaged)
    async_mode: str = "sync"         # trainer.async_rl.mode: "sync", "one_step_off" or "fully_async"
    max_staleness: int = 1           # trainer.async_rl.max_staleness (fully_async)
    num_speculative_tokens: int = 0  # the engines' k (0: they do not draft); fully_async's per-version acceptance


def policy_loss_kwargs(cfg: DictConfig) -> dict[str, Any]:
    algo = cfg.algorithm
    low = float(algo.eps_clip_low)
    # PPO's clip is DAPO's with a symmetric range
    high = low if algo.policy_loss_type == "ppo" else float(algo.eps_clip_high)
    kwargs = {"eps_clip_low": low, "eps_clip_high": high,
              "dual_clip_c": None if algo.dual_clip_c is None else float(algo.dual_clip_c),
              "loss_reduction": str(algo.loss_reduction)}
    op = algo.off_policy
    if op.correction != "none":   # the worker weights the loss by the correction (algorithms/off_policy.py)
        kwargs.update(off_policy_correction=str(op.correction), tis_cap=float(op.tis_cap),
                      tis_level=str(op.tis_level),
                      decoupled_weight_cap=None if op.decoupled_weight_cap is None else float(op.decoupled_weight_cap))
    return kwargs


def loop_config(cfg: DictConfig) -> LoopConfig:
    t, algo = cfg.trainer, cfg.algorithm
    op = algo.overlong_punishment
    head_max_depths = head_depths_follow_engines(cfg)
    return LoopConfig(
        seed=int(t.seed), total_steps=int(t.total_steps), train_batch_size=int(t.train_batch_size),
        mini_batch_size=None if t.policy_mini_batch_size is None else int(t.policy_mini_batch_size),
        shuffle=bool(cfg.data.shuffle), n_samples_per_prompt=int(cfg.generator.n_samples_per_prompt),
        sampling=_sampling(cfg.generator.sampling), eval_sampling=_sampling(cfg.generator.eval_sampling),
        eval_every_n_steps=int(t.eval_every_n_steps), eval_batch_size=int(t.eval_batch_size),
        dynamic_sampling=bool(algo.dynamic_sampling.enabled), max_gen_rounds=int(algo.dynamic_sampling.max_gen_rounds),
        norm_adv_by_std=bool(algo.norm_adv_by_std), loss_kwargs=tuple(sorted(policy_loss_kwargs(cfg).items())),
        overlong_filtering=bool(algo.overlong_filtering),
        overlong_punishment=(bool(op.enabled), int(op.buffer_len), float(op.penalty_factor)),
        dp=int(cfg.megatron.dp), checkpoint_every_n_steps=int(t.checkpoint.every_n_steps),
        keep_last=int(t.checkpoint.keep_last), resume=str(t.resume), progress_bar=bool(t.progress_bar),
        run_dir=str(t.run_dir), head_max_depths=head_max_depths,
        idle_head_train_budget=float(t.mtp.idle_head_train_budget) if head_max_depths is not None else 1.0,
        num_engines=int(cfg.generator.num_engines), async_mode=str(t.async_rl.mode),
        max_staleness=int(t.async_rl.max_staleness), num_speculative_tokens=rollout_speculative_tokens(cfg))


def head_depths_follow_engines(cfg: DictConfig) -> int | None:
    """The most depths the head trains on when they follow the engines' chosen k (auto k, train_depths
    null, the head trained and drafting in rollouts); None when the depths are fixed (train_depths)."""
    mtp = cfg.trainer.mtp
    if not (adaptive_speculation(cfg) and mtp.train_depths is None and rollout_speculative_tokens(cfg) > 0
            and float(mtp.loss_weight) > 0):
        return None
    return train_depths(cfg)


# ---------------------------------------------------------------------------------------------- model / data

@dataclass(frozen=True)
class ModelSource:
    path: str | None          # a user's HF checkpoint, or None: the tiny embedded model below
    tiny: Any                 # skyrl_mtp.models.tiny.TinyModelSpec
    tiny_cache_dir: str | None


def model_source(cfg: DictConfig) -> ModelSource:
    from skyrl_mtp.models.tiny import TinyModelSpec

    t = cfg.model.tiny
    spec = TinyModelSpec(**{k: v for k, v in OmegaConf.to_container(t, resolve=True).items() if k != "cache_dir"})
    return ModelSource(None if cfg.model.path is None else str(Path(cfg.model.path).resolve()), spec, t.cache_dir)


@dataclass(frozen=True)
class DataSettings:
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    synthetic: str | None
    synthetic_params: tuple[tuple[str, Any], ...]   # what the generated data depends on (its cache key)
    synthetic_dir: str | None
    max_prompt_length: int
    skip_malformed: bool
    layout: str                                     # row layout of user files: "dapo" or "searchr1"


def data_settings(cfg: DictConfig) -> DataSettings:
    d = cfg.data
    params = {"task": d.synthetic, "num_train": int(d.synthetic_num_train), "num_val": int(d.synthetic_num_val),
              "seed": int(cfg.trainer.seed), "digits": int(d.synthetic_digits)}
    if d.synthetic == "search":
        params["topk"] = int(cfg.environment.search.topk)
        rels = [str(r) for r in d.synthetic_search_relations]
        if rels != ["capital", "founder", "river", "currency"] or d.synthetic_search_warmstart_entities:
            # only when not the defaults, so the cache key of data generated before these keys is unchanged
            params["relations"] = ",".join(rels)
            params["warmstart_entities"] = int(d.synthetic_search_warmstart_entities)
    layout = "searchr1" if cfg.environment.name == "search" and d.synthetic != "search" else "dapo"
    return DataSettings(tuple(str(p) for p in d.train_files), tuple(str(p) for p in d.val_files), d.synthetic,
                        tuple(sorted(params.items())), d.synthetic_dir, int(d.max_prompt_length),
                        bool(d.skip_malformed), layout)


# ---------------------------------------------------------------------------------------------- environment

@dataclass(frozen=True)
class EnvironmentSettings:
    name: str
    math_answer_pattern: str | None
    math_timeout_s: float
    search_retriever_url: str | None
    search_corpus_file: str | None
    search_topk: int
    search_timeout_s: float
    search_max_retries: int
    search_on_failure: str
    max_turns: int
    max_total_len: int


def environment_settings(cfg: DictConfig) -> EnvironmentSettings:
    e, s = cfg.environment, cfg.environment.search
    return EnvironmentSettings(str(e.name), e.math.answer_pattern, float(e.math.timeout_s), s.retriever_url,
                               s.corpus_file, int(s.topk), float(s.timeout_s), int(s.max_retries), str(s.on_failure),
                               int(cfg.generator.max_turns), int(cfg.generator.max_model_len))


# ---------------------------------------------------------------------------------------------- tracker / placement

def tracker_config(cfg: DictConfig):
    from skyrl_mtp.tracking.tracker import TrackerConfig

    lg = cfg.logger
    return TrackerConfig(backends=tuple(lg.backends), project=str(lg.project), run_name=str(lg.run_name),
                         wandb_mode=str(lg.wandb_mode), plots=bool(lg.plots), verbose=bool(lg.verbose))


def placement_request(cfg: DictConfig):
    """What the run asks of the Ray cluster: its engines and policy ranks, their CPUs and GPUs."""
    from skyrl_mtp.cluster.placement import PlacementRequest

    pl, g = cfg.trainer.placement, cfg.generator
    return PlacementRequest(num_engines=int(g.num_engines), engine_workers=int(g.tensor_parallel_size) * int(g.pipeline_parallel_size),
                            policy_workers=int(pl.policy_num_workers), cpus_per_engine=float(pl.cpus_per_engine),
                            cpus_per_policy_worker=float(pl.cpus_per_policy_worker),
                            gpus_per_engine=int(pl.gpus_per_engine), gpus_per_policy_worker=int(pl.gpus_per_policy_worker),
                            colocate=bool(pl.colocate))


def placement_plan(cfg: DictConfig):
    from skyrl_mtp.cluster.placement import build_plan

    return build_plan(placement_request(cfg))


# ---------------------------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class RunPlan:
    """Every component's settings of one run, built once from its validated config (`build_run_plan`)."""

    policy_worker: Any          # skyrl_mtp.policy.config.PolicyWorkerConfig
    warm_start_worker: Any      # the same, for the supervised warm start's single worker
    warm_start: WarmStartSettings
    engine: Any                 # skyrl_mtp.rollout.config.EngineConfig; model_path set once the model is resolved
    loop: LoopConfig
    model: ModelSource
    data: DataSettings
    environment: EnvironmentSettings
    tracker: Any                # skyrl_mtp.tracking.tracker.TrackerConfig
    placement: Any              # skyrl_mtp.cluster.placement.PlacementPlan
    memory: MemoryPlan | None   # the GPU memory plan (config/memory_plan.py); None on CPU
    config: Any                 # the resolved config as plain containers: written to the run dir and the tracker

    def engine_for(self, model_path: str | Path, draft_model_path: str | None = None, draft_method: str = "eagle3"):
        """The engines' config once the model they serve is known (the user's, the tiny one, or the warm start's)
        and, for a run with an external drafter, the export they start with and its method."""
        from dataclasses import replace

        return replace(self.engine, model_path=str(model_path), draft_model_path=draft_model_path,
                       draft_method=draft_method if draft_model_path is not None else "eagle3")


def build_run_plan(cfg: DictConfig) -> RunPlan:
    """The run plan of a validated config (config.load_config validates it)."""
    return RunPlan(**built_components(cfg), config=OmegaConf.to_container(cfg, resolve=True))


def built_components(cfg: DictConfig, model_path: str = "/model") -> dict[str, Any]:
    """Every component's settings of `cfg`, by RunPlan field (what the key-coverage test compares)."""
    plan = run_memory_plan(cfg)
    memory = plan if plan is not None and plan.device == "gpu" else None
    return {"policy_worker": policy_worker_config(cfg, plan), "warm_start_worker": warm_start_worker_config(cfg),
            "warm_start": warm_start_settings(cfg), "engine": engine_config(cfg, model_path, plan),
            "loop": loop_config(cfg), "model": model_source(cfg), "data": data_settings(cfg),
            "environment": environment_settings(cfg), "tracker": tracker_config(cfg), "placement": placement_plan(cfg),
            "memory": memory}
