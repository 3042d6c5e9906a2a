"""Every recipe in recipes/ validates once the user's paths are filled in; the cluster recipes fit the
hardware their comments promise and fail clearly on less; left-over placeholders name the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from eagle3_target_configs import FOR_DFLASH_RECIPE, FOR_EAGLE3_RECIPE
from model_configs import FOR_RECIPE as HEADLINE_MODELS
from model_configs import write_config

from skyrl_mtp.cluster.placement import PlacementError, plan_placement
from skyrl_mtp.config import ConfigError, load_config
from skyrl_mtp.config.validation import REQUIRED_PREFIX
from skyrl_mtp.trainer.run_plan import placement_plan

REPO = Path(__file__).resolve().parents[3]
FOR_RECIPE = {**HEADLINE_MODELS, **FOR_EAGLE3_RECIPE, **FOR_DFLASH_RECIPE}   # each recipe's model's config.json
EAGLE3_RECIPES = sorted(FOR_EAGLE3_RECIPE)
DFLASH_RECIPES = sorted(FOR_DFLASH_RECIPE)
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


def _placeholders(node, key=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _placeholders(v, f"{key}.{k}" if key else k)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _placeholders(v, f"{key}[{i}]")
    elif isinstance(node, str) and node.startswith(REQUIRED_PREFIX):
        yield key


# a data row in both layouts at once (DAPO-Math: prompt + reward_model; Search-R1: question + golden_answers)
DATA_ROW = {"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"},
            "question": "1+1?", "golden_answers": ["2"]}


def user_overrides(recipe: str, tmp: Path) -> list[str]:
    """What a user passes: a checkpoint dir for model.path, existing files for file lists, a retriever."""
    raw = yaml.safe_load((REPO / "recipes" / f"{recipe}.yaml").read_text())
    overrides, lists = [], {}
    for key in _placeholders(raw):
        if key == "model.path":   # the recipe's model's config.json: the GPU memory plan reads its sizes
            overrides.append(f"model.path={write_config(tmp / 'ckpt', FOR_RECIPE[recipe])}")
        elif "[" in key:
            base = key.split("[")[0]
            path = tmp / f"{base.replace('.', '_')}_{len(lists.get(base, []))}.jsonl"
            path.write_text(json.dumps(DATA_ROW) + "\n")
            lists.setdefault(base, []).append(str(path))
        else:
            path = tmp / key.replace(".", "_")
            path.touch()
            overrides.append(f"{key}={path}")
    overrides += [f"{base}=[{','.join(paths)}]" for base, paths in lists.items()]
    env = raw.get("environment", {})
    search = env.get("search") or {}
    if env.get("name") == "search" and not search.get("retriever_url") and not search.get("corpus_file") \
            and (raw.get("data") or {}).get("synthetic") != "search":
        overrides.append("environment.search.retriever_url=http://127.0.0.1:8000")
    return overrides


def test_the_gpu_recipes_name_their_layers_and_the_plan_counts_them_wherever_they_are_submitted(tmp_path):
    # the plan reads megatron.layer_impl, not what the submitting machine has installed (this one has no TE)
    for name in ("mimo7b_dapo", "mimo7b_searchr1", "qwen3_5_9b_dapo", "qwen3_5_27b_dapo", "qwen3next_dapo",
                 "glm4_5_air_dapo", "qwen3_5_35b_a3b_dapo", *EAGLE3_RECIPES, *DFLASH_RECIPES):
        cfg = load_config([f"recipe={name}", *user_overrides(name, tmp_path / name)])
        assert cfg.megatron.layer_impl == "transformer_engine", name


def test_with_the_local_layers_the_headline_recipe_is_refused_with_a_setting_that_fits(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(["recipe=mimo7b_dapo", *user_overrides("mimo7b_dapo", tmp_path), "megatron.layer_impl=local"])
    (msg,) = info.value.problems
    assert msg.startswith("megatron.layer_impl='local' is invalid: a training step needs ")
    assert "settings that fit: megatron.layer_impl=sdpa needs" in msg


def test_the_cluster_recipes_exist():
    assert {"tiny_dapo", "mimo7b_dapo", "mimo7b_searchr1", "qwen3next_dapo", "glm4_5_air_dapo",
            "qwen3_5_27b_dapo", "qwen3_5_35b_a3b_dapo", "llama3_1_8b_eagle3_dapo", "qwen3_8b_eagle3_dapo",
            "qwen3_8b_dflash_dapo"} <= set(RECIPES)


RUNNABLE = RECIPES


def test_a_checkpoint_whose_model_the_trainer_cannot_build_is_refused_naming_the_path(tmp_path):
    overrides = user_overrides("mimo7b_dapo", tmp_path)
    ckpt = tmp_path / "gpt2"
    write_config(ckpt, {**FOR_RECIPE["mimo7b_dapo"], "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ConfigError) as info:
        load_config(["recipe=mimo7b_dapo", *overrides, f"model.path={ckpt}"])
    (msg,) = info.value.problems
    assert msg.startswith(f"model.path='{ckpt}' is invalid: its config.json has architectures=['GPT2LMHeadModel'] "
                          "(model_type='gpt2'), which no model family reads; supported architectures: [")
    assert "'MiMoForCausalLM'" in msg and "'DeepseekV3ForCausalLM'" in msg


def _compose(recipe: str, tmp: Path):
    """The recipe with the user's paths, validated where the trainer can build its model."""

    overrides = [f"recipe={recipe}", *user_overrides(recipe, tmp)]
    return load_config(overrides)


@pytest.mark.parametrize("recipe", RUNNABLE)
def test_recipe_validates_with_user_paths(recipe, tmp_path):
    cfg = load_config([f"recipe={recipe}", *user_overrides(recipe, tmp_path)])
    if cfg.trainer.mtp.enabled and cfg.trainer.mtp.draft_in_rollouts and cfg.trainer.drafter.kind == "mtp":
        from skyrl_mtp.trainer.run_plan import engine_config

        spec = engine_config(cfg, tmp_path).speculative_config   # derived from trainer.mtp only
        assert spec["method"] == "mtp" and spec["num_speculative_tokens"] == cfg.trainer.mtp.num_speculative_tokens


@pytest.mark.parametrize("recipe", ["mimo7b_dapo", "mimo7b_searchr1", "qwen3next_dapo", "qwen3_5_9b_dapo",
                                    "glm4_5_air_dapo", "qwen3_5_27b_dapo", "qwen3_5_35b_a3b_dapo", *EAGLE3_RECIPES,
                                    *DFLASH_RECIPES])
def test_unset_user_paths_are_named(recipe):
    with pytest.raises(ConfigError) as info:
        load_config([f"recipe={recipe}"])
    msg = str(info.value)
    assert "model.path='REQUIRED: " in msg
    assert "this recipe leaves it for you to set; pass model.path=/your/path on the command line" in msg
    assert "data.train_files[0]='REQUIRED: " in msg and "pass data.train_files=[/your/file,...]" in msg


def test_search_recipe_needs_a_retriever(tmp_path):
    overrides = [o for o in user_overrides("mimo7b_searchr1", tmp_path) if "retriever_url" not in o]
    with pytest.raises(ConfigError, match="environment.search.retriever_url=None is invalid: the search environment "
                                          "needs a retriever_url or a corpus_file"):
        load_config(["recipe=mimo7b_searchr1", *overrides])


# (recipe, nodes it promises, GPUs it needs, k)
HARDWARE = [
    ("mimo7b_dapo", [{"CPU": 32.0, "GPU": 8.0}], 8, 3),
    ("mimo7b_searchr1", [{"CPU": 32.0, "GPU": 8.0}], 8, 3),
    ("qwen3_5_9b_dapo", [{"CPU": 32.0, "GPU": 8.0}], 8, 3),
    ("qwen3next_dapo", [{"CPU": 24.0, "GPU": 8.0}] * 4, 32, 2),
    ("glm4_5_air_dapo", [{"CPU": 24.0, "GPU": 8.0}] * 4, 32, 2),
    ("qwen3_5_27b_dapo", [{"CPU": 32.0, "GPU": 8.0}] * 2, 16, 3),
    ("qwen3_5_35b_a3b_dapo", [{"CPU": 32.0, "GPU": 8.0}] * 2, 16, 2),
    ("llama3_1_8b_eagle3_dapo", [{"CPU": 32.0, "GPU": 8.0}], 8, 3),
    ("qwen3_8b_eagle3_dapo", [{"CPU": 32.0, "GPU": 8.0}], 8, 3),
    ("qwen3_8b_dflash_dapo", [{"CPU": 32.0, "GPU": 8.0}], 8, 7),
]

MOE_MODELS = {r: FOR_RECIPE[r] for r in ("qwen3next_dapo", "glm4_5_air_dapo", "qwen3_5_35b_a3b_dapo")}   # the released models' shapes


@pytest.mark.parametrize("recipe", sorted(MOE_MODELS))
def test_moe_recipes_layout_is_one_their_model_family_trains(recipe, tmp_path):
    """Validation's check of the real model's shapes (nothing built): the family accepts the recipe's tp / ep and
    refuses tensor parallelism (MoE training needs sequence parallelism there), naming megatron.tp."""
    ckpt = write_config(tmp_path / "model", MOE_MODELS[recipe])
    overrides = [o for o in user_overrides(recipe, tmp_path) if not o.startswith("model.path=")]
    cfg = load_config([f"recipe={recipe}", *overrides, f"model.path={ckpt}"])
    assert cfg.megatron.tp == 1 and cfg.megatron.ep > 1
    with pytest.raises(ConfigError) as info:
        load_config([f"recipe={recipe}", *overrides, f"model.path={ckpt}", "megatron.tp=2", "megatron.dp=16"])
    (msg,) = [p for p in info.value.problems if p.startswith("megatron.tp=")]
    assert msg.startswith("megatron.tp=2 is invalid: with a ") and "(MoE) model" in msg and "allowed: tp=1" in msg


@pytest.mark.parametrize("recipe, nodes, gpus, k", HARDWARE)
def test_cluster_recipe_fits_its_documented_hardware(recipe, nodes, gpus, k, tmp_path):
    cfg = _compose(recipe, tmp_path)
    assert cfg.trainer.mtp.num_speculative_tokens == k
    total = {r: sum(n[r] for n in nodes) for r in ("CPU", "GPU")}
    plan = plan_placement(placement_plan(cfg), total, nodes)
    assert plan.device == "gpu" and plan.colocate
    assert plan.required["GPU"] == gpus
    assert len(plan.policy) == cfg.megatron.tp * cfg.megatron.pp * cfg.megatron.cp * cfg.megatron.dp == gpus
    with pytest.raises(PlacementError, match=f"cluster too small: needs {gpus} GPUs"):
        plan_placement(placement_plan(cfg), {**total, "GPU": gpus - 1.0})


@pytest.mark.parametrize("recipe", RUNNABLE)
def test_recipe_builds_its_policy_and_engine_configs(recipe, tmp_path):
    """What the launcher hands the policy workers and the engines is built (and validated) for every recipe."""
    from skyrl_mtp.trainer.run_plan import engine_config, policy_worker_config

    cfg = load_config([f"recipe={recipe}", *user_overrides(recipe, tmp_path)])
    policy = policy_worker_config(cfg)
    m = cfg.megatron
    assert (policy.tp, policy.pp, policy.dp) == (m.tp, m.pp, m.dp)
    assert policy.tp * policy.pp * policy.dp == cfg.trainer.placement.policy_num_workers
    assert policy.dtype == m.dtype and policy.micro_batch_size == m.micro_batch_size
    engine = engine_config(cfg, Path(cfg.model.path or tmp_path / "built_tiny_model"))  # tiny: built at launch
    assert engine.num_engines == cfg.generator.num_engines
    assert engine.tensor_parallel_size == cfg.generator.tensor_parallel_size
    assert engine.pipeline_parallel_size == cfg.generator.pipeline_parallel_size


@pytest.mark.parametrize("recipe", EAGLE3_RECIPES)
def test_eagle3_recipes_train_the_drafter_beside_the_policy_and_fit_without_offload(recipe, tmp_path):
    """The policy workers train an EAGLE-3 drafter (no MTP layers), for every depth the engines draft, and the plan
    fits with the policy's grads and optimizer state on the GPU while the engines are awake (the drafter's own
    optimizer side has no host offload)."""
    from skyrl_mtp.config.memory_drafter import eagle3_param_count
    from skyrl_mtp.config.memory_plan import memory_plan, model_shape
    from skyrl_mtp.trainer.run_plan import engine_config, policy_worker_config

    cfg = load_config([f"recipe={recipe}", *user_overrides(recipe, tmp_path)])
    worker = policy_worker_config(cfg)
    assert worker.drafter_kind == "eagle3" and not worker.mtp_enabled and worker.mtp_num_layers == 0
    assert worker.mtp_num_depths == engine_config(cfg, tmp_path).num_speculative_tokens == 3
    hf = FOR_RECIPE[recipe]
    plan = memory_plan(cfg, hf)
    assert plan.policy.drafter == 16 * eagle3_param_count(model_shape(cfg, hf)) > 4e9
    assert plan.policy.step_peak[0] == "draft loss" and plan.engine.drafter > 0
    assert not plan.offload_while_engines_awake and not plan.problems
    assert plan.peak[1] < 0.92 * plan.usable                  # ~6 GB (qwen3) to ~10 GB (llama) of margin


@pytest.mark.parametrize("recipe", DFLASH_RECIPES)
def test_dflash_recipes_train_the_drafter_beside_the_policy_and_fit_without_offload(recipe, tmp_path):
    """The policy workers train a DFlash drafter (no MTP layers) whose block holds every draft the engines make, and
    the plan fits with the policy's grads and optimizer state on the GPU while the engines are awake, the drafter's
    state whole on every rank and its layers' K/V in every engine's cache."""
    from skyrl_mtp.config.memory_drafter import dflash_param_count, dflash_settings
    from skyrl_mtp.config.memory_plan import memory_plan, model_shape
    from skyrl_mtp.trainer.run_plan import engine_config, policy_worker_config

    cfg = load_config([f"recipe={recipe}", *user_overrides(recipe, tmp_path)])
    worker = policy_worker_config(cfg)
    assert worker.drafter_kind == "dflash" and not worker.mtp_enabled and worker.mtp_num_layers == 0
    k = engine_config(cfg, tmp_path).num_speculative_tokens
    assert worker.drafter_block_size == k + 1 == 8 and worker.drafter_num_layers == 2
    hf = FOR_RECIPE[recipe]
    shape = model_shape(cfg, hf)
    plan = memory_plan(cfg, hf)
    assert plan.policy.drafter == 16 * dflash_param_count(shape, dflash_settings(cfg, shape)) > 6e9
    assert plan.policy.draft_loss > 0 and plan.engine.drafter > 0
    assert not plan.offload_while_engines_awake and not plan.problems
    assert plan.peak[1] < 0.92 * plan.usable


# the recipes of models too large for one pipeline stage per GPU group: (recipe, policy pp, engine pp)
PIPELINED = [("qwen3_5_27b_dapo", 2, 2)]


@pytest.mark.parametrize("recipe, policy_pp, engine_pp", PIPELINED)
def test_large_recipes_pipeline_both_sides(recipe, policy_pp, engine_pp, tmp_path):
    from skyrl_mtp.trainer.run_plan import engine_config, policy_worker_config

    cfg = load_config([f"recipe={recipe}", *user_overrides(recipe, tmp_path)])
    engine = engine_config(cfg, Path(cfg.model.path))
    assert policy_worker_config(cfg).pp == policy_pp and engine.pipeline_parallel_size == engine_pp
    assert engine.workers_per_engine == cfg.trainer.placement.gpus_per_engine
    # the engines draft under pipeline parallelism through the patched V1 runner and scheduler
    from skyrl_mtp.rollout.config import PIPELINE_PARALLEL_SCHEDULER_CLS

    assert engine.managed_engine_kwargs("x")["scheduler_cls"] == PIPELINE_PARALLEL_SCHEDULER_CLS


def test_context_parallel_is_rejected_naming_the_key(tmp_path):
    overrides = user_overrides("mimo7b_dapo", tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(["recipe=mimo7b_dapo", *overrides, "megatron.cp=2", "megatron.dp=4"])
    msg = str(info.value)
    assert "megatron.cp=2 is invalid: only 1 is supported" in msg and "context parallelism is not implemented" in msg
