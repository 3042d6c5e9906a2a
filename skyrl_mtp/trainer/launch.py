"""`run(cfg)`: everything between a validated config and a finished run, wiring only.

Resolves the model (a user checkpoint, or the tiny embedded one built once and cached), the data
(user files, or the synthetic task generated locally), checks both before any actor starts, runs
the cached warm start when asked, starts Ray, the vLLM engines and the Megatron policy workers,
builds the environment, resumes from the run directory when possible, trains, then writes plots
and prints the summary. Returns the process exit code.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from skyrl_mtp.errors import ConfigError, problem
from skyrl_mtp.runtime_env import configure_offline_caches
from skyrl_mtp.trainer.run_plan import RunPlan, build_run_plan


def log(msg: str) -> None:
    print(f"[skyrl-mtp] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    return Path(os.environ.get("SKYRL_MTP_CACHE", ".cache")).resolve()


# ---------------------------------------------------------------------------------------------- model / data

def resolve_model(plan: RunPlan, cache: Path) -> Path:
    src = plan.model
    if src.path is not None:
        return Path(src.path)
    from skyrl_mtp.models.tiny import cached_tiny_checkpoint

    root = Path(src.tiny_cache_dir) if src.tiny_cache_dir else cache / "models"
    path = cached_tiny_checkpoint(root, src.tiny)
    log(f"tiny model: {path}")
    return path


def synthetic_data(plan: RunPlan, cache: Path) -> dict[str, Path]:
    d = plan.data
    params = dict(d.synthetic_params)
    key_params = {k: v for k, v in params.items() if k != "topk"}   # the cache key of data generated before topk
    key = hashlib.sha256(json.dumps(key_params, sort_keys=True).encode()).hexdigest()[:12]
    if "topk" in params:
        key += f"-k{params['topk']}"
    out = Path(d.synthetic_dir) if d.synthetic_dir else cache / "data" / f"{d.synthetic}-{key}"
    if d.synthetic == "arithmetic":
        from skyrl_mtp.data.arithmetic_task import ArithmeticTaskConfig, write_arithmetic_dataset

        if not (out / "test.parquet").exists():
            write_arithmetic_dataset(out, ArithmeticTaskConfig(digits=params["digits"], num_train=params["num_train"],
                                                               num_test=params["num_val"], seed=params["seed"]))
        return {"train": out / "train.parquet", "val": out / "test.parquet"}
    from skyrl_mtp.data.search_task import write_search_task

    if not (out / "stats.json").exists():
        write_search_task(out, search_task_spec(params))
    return {"train": out / "train.parquet", "val": out / "test.parquet", "corpus": out / "corpus.jsonl",
            "warmstart": out / "warmstart.parquet"}


def search_task_spec(params: dict[str, Any]):
    """The synthetic search task of data.synthetic_* : num_train + num_val facts over the asked relations,
    num_val of them held out for eval (never in the warm start nor in RL training)."""
    from skyrl_mtp.data.search_task import RELATION_NAMES, SearchTaskSpec

    rels = tuple(params["relations"].split(",")) if "relations" in params else RELATION_NAMES
    if "relations" not in params:   # data generated before data.synthetic_search_* existed: keep its layout
        return SearchTaskSpec(num_entities=min(max(1, params["num_train"] // 4), 5000), seed=params["seed"],
                              topk=params["topk"])
    num_entities = min(-(-(params["num_train"] + params["num_val"]) // len(rels)), 5000)
    return SearchTaskSpec(num_entities=num_entities, relations=rels, seed=params["seed"], topk=params["topk"],
                          test_fraction=min(params["num_val"] / (num_entities * len(rels)), 0.5),
                          num_warmstart_entities=params["warmstart_entities"])


def load_examples(plan: RunPlan, paths: list[Path], tokenizer: Any, what: str) -> list:
    from skyrl_mtp.data.datasets import load_prompt_dataset
    from skyrl_mtp.envs.environments import encode_prompt

    d = plan.data
    out, skipped, too_long = [], 0, 0
    for i, p in enumerate(paths):
        try:
            ds = load_prompt_dataset(p, layout=d.layout, skip_malformed=d.skip_malformed)
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError([problem(f"data.{what}_files[{i}]", str(p), f"could not be loaded: {err}")]) from None
        skipped += ds.num_skipped
        for ex in ds.examples:
            if len(encode_prompt(tokenizer, ex.prompt)) > d.max_prompt_length:
                too_long += 1
            else:
                out.append(ex)
    if skipped or too_long:
        log(f"{what} data: skipped {skipped} malformed rows and {too_long} prompts longer than "
            f"data.max_prompt_length={d.max_prompt_length}")
    if not out:
        raise ConfigError([problem(f"data.{what}_files", [str(p) for p in paths], "no usable rows")])
    return out


def warm_start_examples(plan: RunPlan, data: dict[str, Path], tokenizer: Any) -> list:
    from skyrl_mtp.envs.environments import encode_prompt
    from skyrl_mtp.trainer.warm_start import SFTExample

    eos = [tokenizer.eos_token_id]
    out = []
    if plan.data.synthetic == "arithmetic":
        from skyrl_mtp.data.arithmetic_task import ArithmeticTaskConfig, generate_rows, sft_examples

        params = dict(plan.data.synthetic_params)
        rows = generate_rows(ArithmeticTaskConfig(digits=params["digits"], num_train=params["num_train"],
                                                  num_test=0, seed=params["seed"]))["train"]
        for ex in sft_examples(rows):
            resp = tokenizer.encode(ex["response"], add_special_tokens=False) + eos
            out.append(SFTExample(encode_prompt(tokenizer, ex["prompt"]), resp))
        return out
    if plan.data.synthetic == "search":
        import datasets

        for row in datasets.load_dataset("parquet", data_files=str(data["warmstart"]), split="train"):
            resp, mask = [], []
            for seg in row["segments"]:
                ids = tokenizer.encode(seg["text"], add_special_tokens=False)
                resp += ids
                mask += [1 if seg["role"] == "policy" else 0] * len(ids)
            out.append(SFTExample(encode_prompt(tokenizer, row["prompt"]), resp + eos, mask + [1]))
        return out
    raise ConfigError([problem("trainer.warm_start.enabled", True,
                               "warm start is defined for the synthetic tasks only (data.synthetic=arithmetic|search)")])


# ---------------------------------------------------------------------------------------------- workers

def start_ray(plan: RunPlan) -> None:
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)   # inside `ray job submit`: join the cluster
        return
    from skyrl_mtp.tracking.quiet_logs import filter_ray_handlers, ray_init_kwargs

    verbose = plan.tracker.verbose
    if not verbose:
        filter_ray_handlers()
    need = plan.placement.required["CPU"]
    ray.init(num_cpus=max(int(math.ceil(need)), os.cpu_count() or 1), include_dashboard=False,
             **ray_init_kwargs(verbose))


def build_environment(plan: RunPlan, client: Any, tokenizer: Any, data: dict[str, Path]):
    from skyrl_mtp.envs.environments import MathEnvironment, SearchEnvironment

    e = plan.environment
    if e.name == "math":
        from skyrl_mtp.envs.math_reward import MathReward

        return MathEnvironment(client, tokenizer, MathReward(answer_pattern=e.math_answer_pattern,
                                                             timeout_s=e.math_timeout_s))
    from skyrl_mtp.envs.retriever.client import RetrieverClient

    server = None
    url = e.search_retriever_url
    if url is None:
        from skyrl_mtp.envs.retriever.server import start_retriever_in_thread

        corpus = e.search_corpus_file or data.get("corpus")
        server = start_retriever_in_thread(corpus)
        url = server.url
        log(f"retriever: serving {corpus} at {url}")
    retriever = RetrieverClient(url, timeout_s=e.search_timeout_s, max_retries=e.search_max_retries, topk=e.search_topk)
    return SearchEnvironment(client, tokenizer, retriever, max_turns=e.max_turns, max_total_len=e.max_total_len,
                             on_failure=e.search_on_failure, stop_server=server)


# ---------------------------------------------------------------------------------------------- run

def run(cfg: DictConfig) -> int:
    """Run a validated config (config.load_config's); returns the exit status."""
    from skyrl_mtp.errors import PlacementError, RunStoppedError

    try:
        return _run(build_run_plan(cfg))
    except ConfigError as err:
        print(f"skyrl-mtp: {err}", file=sys.stderr)
        return 2
    except PlacementError as err:
        print(f"skyrl-mtp: placement: {err}", file=sys.stderr)
        return 2
    except RunStoppedError as err:   # an engine died, a loss went non-finite: named, checkpoint intact
        print(f"skyrl-mtp: error: {err}", file=sys.stderr)
        return 1


def _run(plan: RunPlan) -> int:
    import ray
    from transformers import AutoTokenizer

    from skyrl_mtp.tracking.quiet_logs import quiet_library_logs
    from skyrl_mtp.tracking.tracker import Tracker
    from skyrl_mtp.trainer.run_dir import RunDir

    t_start = time.perf_counter()
    cache = cache_root()
    configure_offline_caches(cache)
    quiet_library_logs(plan.tracker.verbose, cache / "logging")   # before Ray starts: workers inherit it
    base_model = resolve_model(plan, cache)
    data = synthetic_data(plan, cache) if plan.data.synthetic else {}
    train_files = [Path(p) for p in plan.data.train_files] or [data["train"]]
    val_files = [Path(p) for p in plan.data.val_files] or ([data["val"]] if "val" in data else [])
    tokenizer = AutoTokenizer.from_pretrained(str(base_model))
    train = load_examples(plan, train_files, tokenizer, "train")
    val = load_examples(plan, val_files, tokenizer, "val") if val_files else []
    loop = plan.loop
    run_dir = RunDir(loop.run_dir)
    run_dir.create(plan.config)

    start_ray(plan)
    engines = policy = env = tracker = placement_group = None
    try:
        from skyrl_mtp.cluster.placement import plan_for_running_cluster, release, reserve

        placement = plan_for_running_cluster(plan.placement)   # a cluster too small fails here, before any actor
        log(placement.describe())
        model_path = base_model
        if plan.warm_start.enabled:
            model_path = _warm_start(plan, base_model, data, tokenizer, cache)
        if plan.memory is not None:   # checked at validation; printed here with the checkpoint the run serves
            log(plan.memory.describe())
        placement_group = reserve(placement)
        drafter_path = _initial_drafter(plan, model_path, run_dir, tokenizer)
        engines, policy = _start_workers(plan, model_path, placement_group, drafter_path)
        env = build_environment(plan, engines, tokenizer, data)
        from skyrl_mtp.trainer.trainer import RLTrainer
        from skyrl_mtp.weight_sync.policy_link import PolicyEngineLink
        from skyrl_mtp.weight_sync.step_sync import StepSync

        weight_sync = StepSync(PolicyEngineLink(policy.workers, engines), engines, colocate=placement.colocate,
                               policy=policy)
        trainer = RLTrainer(loop, engines=engines, policy=policy, env=env, tokenizer=tokenizer,
                            train_examples=train, val_examples=val, run_dir=run_dir, tracker=None, log=log,
                            weight_sync=weight_sync)
        resumed = trainer.resume_if_possible()
        tracker = Tracker.from_config(run_dir.root, plan.tracker, config=plan.config, resume_step=resumed,
                                      stream=sys.stderr)
        trainer.tracker = tracker
        _write_run_info(run_dir, model_path, engines, policy, placement, placement_group)
        if resumed:
            trainer.sync_weights()
        elif loop.eval_every_n_steps and val:
            tracker.log(trainer.evaluate(), step=0)
        log(f"ready after {time.perf_counter() - t_start:.1f}s; training steps {resumed + 1}..{loop.total_steps}")
        trainer.fit()
    finally:
        for closer in (env, tracker):
            if closer is not None:
                closer.close()
        if engines is not None:
            engines.shutdown()
        if policy is not None:
            policy.shutdown()
        if placement_group is not None:
            release(placement_group)
        if ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):
            ray.shutdown()
    _finish(plan, run_dir)
    log(f"done in {time.perf_counter() - t_start:.1f}s; run dir {run_dir.root.resolve()}")
    return 0


def _warm_start(plan: RunPlan, base_model: Path, data: dict[str, Path], tokenizer: Any, cache: Path) -> Path:
    from skyrl_mtp.policy.worker import PolicyWorker
    from skyrl_mtp.trainer.warm_start import warm_start

    ws = plan.warm_start
    actor_opts = plan.placement.policy[0]

    def start_worker(path: Path, lr: float):
        import ray

        wcfg = plan.warm_start_worker
        if lr != wcfg.policy_lr:
            raise ValueError(f"warm start asked for lr={lr}, its worker config has {wcfg.policy_lr}")
        actor = PolicyWorker.options(num_cpus=actor_opts.num_cpus, num_gpus=actor_opts.num_gpus) \
            .remote(wcfg, str(path), 0, 1)
        ray.get(actor.join.remote(*ray.get(actor.rendezvous_address.remote())))
        return actor

    root = Path(ws.cache_dir) if ws.cache_dir else cache / "warm_start"
    return warm_start(base_model, root, warm_start_examples(plan, data, tokenizer), ws.plan,
                      tokenizer.pad_token_id, start_worker, log=log)


def _initial_drafter(plan: RunPlan, model_path: Path, run_dir: Any, tokenizer: Any) -> str | None:
    """An external drafter's export as the engines start with it, the one the policy workers start from: the user's
    trainer.drafter.init, or the fresh drafter of trainer.seed exported into the run directory."""
    w = plan.policy_worker
    if w.drafter_kind == "mtp":
        return None
    if w.drafter_kind == "dflash":
        vocab = json.loads((model_path / "config.json").read_text())["vocab_size"]
        mask = vocab - 1 if w.drafter_mask_token_id is None else w.drafter_mask_token_id
        used = mask < len(tokenizer)
        log(f"DFlash mask slots embed token {mask}" + (
            f" ({tokenizer.convert_ids_to_tokens(mask)!r}, a token of the tokenizer: the vocabulary has no unused row; "
            "set trainer.drafter.mask_token_id to a reserved one)" if used else " (an unused row of the vocabulary)"))
    if w.drafter_init is not None:
        return w.drafter_init
    from skyrl_mtp.policy.drafter_training import write_initial_export

    return str(write_initial_export(w, model_path, run_dir.root / "drafter_init"))


def _start_workers(plan: RunPlan, model_path: Path, placement_group: Any, drafter_path: str | None = None):
    """Engines and policy ranks, each in its bundle of the plan's placement group with the plan's
    per-actor resources (a colocated engine takes 0 GPUs: Ray accounts its GPUs to the policy ranks
    that share them)."""
    from skyrl_mtp.cluster.placement import actor_options
    from skyrl_mtp.rollout.client import EngineClient
    from skyrl_mtp.trainer.policy_group import PolicyGroup

    placement, wcfg = plan.placement, plan.policy_worker
    ecfg = plan.engine_for(model_path, draft_model_path=drafter_path, draft_method=wcfg.drafter_kind)
    engine_options = [actor_options(placement_group, a) for a in placement.engines]

    def start_policy() -> PolicyGroup:
        return PolicyGroup.create(wcfg, str(model_path), len(placement.policy), wcfg.tp, wcfg.pp, 1, wcfg.dp,
                                  per_rank_options=[actor_options(placement_group, a) for a in placement.policy])

    if placement.colocate:   # Ray hides every GPU from a 0-GPU actor: show each engine its policy ranks' GPUs
        from skyrl_mtp.rollout.engine import colocated_gpu_options

        policy = start_policy()
        try:
            # vLLM starts only where gpu_memory_utilization x the GPU is free: the policy hands its memory over first
            policy.release_device_memory()
            gpu_ids = policy.gpu_ids()
            engine_options = [{**o, **colocated_gpu_options([gpu_ids[r] for r in a.shares_gpus_with])}
                              for o, a in zip(engine_options, placement.engines)]
            return EngineClient.create(ecfg, per_engine_options=engine_options), policy
        except BaseException:
            policy.shutdown()
            raise
    with ThreadPoolExecutor(max_workers=1) as pool:
        fut = pool.submit(EngineClient.create, ecfg, per_engine_options=engine_options)
        try:
            policy = start_policy()
        except BaseException:
            try:
                fut.result().shutdown()
            except Exception:  # noqa: BLE001 - report the policy error, not this one
                pass
            raise
        try:
            engines = fut.result()
        except BaseException:
            policy.shutdown()
            raise
    return engines, policy


def _actor_placement_groups(actors: list[Any]) -> list[str | None]:
    """The placement group each actor actually runs in (asked of the actor itself)."""
    import ray

    def where(_self: Any) -> str | None:
        return ray.get_runtime_context().get_placement_group_id()

    return ray.get([a.__ray_call__.remote(where) for a in actors])


def _write_run_info(run_dir, model_path: Path, engines: Any, policy: Any, placement: Any,
                    placement_group: Any) -> None:
    info = {
        "placement": {"placement_group": placement_group.id.hex(), "strategy": placement.strategy,
                      "bundles": list(placement.bundles),
                      "engine_bundles": [a.bundle_index for a in placement.engines],
                      "policy_bundles": [a.bundle_index for a in placement.policy],
                      "engine_actors_in": _actor_placement_groups(engines.actors),
                      "policy_actors_in": _actor_placement_groups(policy.workers)},
        "model_path": str(model_path),
        "engines": [{k: v for k, v in e.items() if k != "schema"} for e in engines.engine_infos],
        "engine_config": {"num_speculative_tokens": engines.cfg.num_speculative_tokens,
                          "speculative_config": engines.cfg.speculative_config},
        "engine_speculative_tokens": engines.running_speculative_tokens(),
        "policy_worker_config": policy.worker_config(),
    }
    (run_dir.root / "run_info.json").write_text(json.dumps(info, indent=2, default=str))


def _finish(plan: RunPlan, run_dir) -> None:
    from skyrl_mtp.tracking.summary import format_summary, summarize

    if not run_dir.metrics_file.exists():
        return
    if plan.tracker.plots:
        from skyrl_mtp.tracking.plots import write_plots

        written = write_plots(run_dir.metrics_file, run_dir.plots)
        log(f"plots: {', '.join(p.name for p in written)} in {run_dir.plots}")
    print("\n" + format_summary(summarize(run_dir.metrics_file)), flush=True)
