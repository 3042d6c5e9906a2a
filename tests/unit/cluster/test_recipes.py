"""Every recipe in recipes/ validates once the user's paths are filled in; the cluster recipes fit the
hardware their comments promise and fail clearly on less; left-over placeholders name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from skyrl_mtp.cluster.placement import PlacementError, plan_placement
from skyrl_mtp.config import ConfigError, load_config
from skyrl_mtp.config.validation import REQUIRED_PREFIX

REPO = Path(__file__).resolve().parents[3]
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


def user_overrides(recipe: str, tmp: Path) -> list[str]:
    """What a user passes: a checkpoint dir for model.path, existing files for file lists, a retriever."""
    raw = yaml.safe_load((REPO / "recipes" / f"{recipe}.yaml").read_text())
    overrides, lists = [], {}
    for key in _placeholders(raw):
        if key == "model.path":
            ckpt = tmp / "ckpt"
            ckpt.mkdir(exist_ok=True)
            (ckpt / "config.json").write_text("{}")
            overrides.append(f"model.path={ckpt}")
        elif "[" in key:
            base = key.split("[")[0]
            path = tmp / f"{base.replace('.', '_')}_{len(lists.get(base, []))}.parquet"
            path.touch()
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


def test_the_cluster_recipes_exist():
    assert {"tiny_dapo", "mimo7b_dapo", "mimo7b_searchr1", "qwen3next_dapo", "qwen3_5_27b_dapo"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_validates_with_user_paths(recipe, tmp_path):
    cfg = load_config([f"recipe={recipe}", *user_overrides(recipe, tmp_path)])
    if cfg.trainer.mtp.enabled and cfg.trainer.mtp.draft_in_rollouts:
        from skyrl_mtp.config.build import engine_config

        spec = engine_config(cfg, tmp_path).speculative_config   # derived from trainer.mtp only
        assert spec["method"] == "mtp" and spec["num_speculative_tokens"] == cfg.trainer.mtp.num_speculative_tokens


@pytest.mark.parametrize("recipe", ["mimo7b_dapo", "mimo7b_searchr1", "qwen3next_dapo", "qwen3_5_9b_dapo",
                                    "qwen3_5_27b_dapo"])
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
    ("qwen3_5_27b_dapo", [{"CPU": 32.0, "GPU": 8.0}] * 2, 16, 3),
]


@pytest.mark.parametrize("recipe, nodes, gpus, k", HARDWARE)
def test_cluster_recipe_fits_its_documented_hardware(recipe, nodes, gpus, k, tmp_path):
    cfg = load_config([f"recipe={recipe}", *user_overrides(recipe, tmp_path)])
    assert cfg.trainer.mtp.num_speculative_tokens == k
    total = {r: sum(n[r] for n in nodes) for r in ("CPU", "GPU")}
    plan = plan_placement(cfg, total, nodes)
    assert plan.device == "gpu" and plan.colocate
    assert plan.required["GPU"] == gpus
    assert len(plan.policy) == cfg.megatron.tp * cfg.megatron.pp * cfg.megatron.cp * cfg.megatron.dp == gpus
    with pytest.raises(PlacementError, match=f"cluster too small: needs {gpus} GPUs"):
        plan_placement(cfg, {**total, "GPU": gpus - 1.0})


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_builds_its_policy_and_engine_configs(recipe, tmp_path):
    """What the launcher hands the policy workers and the engines is built (and validated) for every recipe."""
    from skyrl_mtp.config.build import engine_config, policy_worker_config

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


# the recipes of models too large for one pipeline stage per GPU group: (recipe, policy pp, engine pp)
PIPELINED = [("qwen3next_dapo", 4, 2), ("qwen3_5_27b_dapo", 2, 2)]


@pytest.mark.parametrize("recipe, policy_pp, engine_pp", PIPELINED)
def test_large_recipes_pipeline_both_sides(recipe, policy_pp, engine_pp, tmp_path):
    from skyrl_mtp.config.build import engine_config, policy_worker_config

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
