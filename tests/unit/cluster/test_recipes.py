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
    assert {"tiny_dapo", "mimo7b_dapo", "mimo7b_searchr1", "qwen3next_dapo", "glm4_5_air_dapo"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_validates_with_user_paths(recipe, tmp_path):
    cfg = load_config([f"recipe={recipe}", *user_overrides(recipe, tmp_path)])
    if cfg.trainer.mtp.enabled and cfg.trainer.mtp.draft_in_rollouts:
        from skyrl_mtp.config.build import engine_config

        spec = engine_config(cfg, tmp_path).speculative_config   # derived from trainer.mtp only
        assert spec["method"] == "mtp" and spec["num_speculative_tokens"] == cfg.trainer.mtp.num_speculative_tokens


@pytest.mark.parametrize("recipe", ["mimo7b_dapo", "mimo7b_searchr1", "qwen3next_dapo", "qwen3_5_9b_dapo",
                                    "glm4_5_air_dapo"])
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
]

# config.json fields of the MoE recipes' checkpoints (the released models' shapes)
MOE_MODELS = {
    "qwen3next_dapo": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "intermediate_size": 5120, "vocab_size": 151936, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "partial_rotary_factor": 0.25, "rope_theta": 10000000, "mtp_num_hidden_layers": 1},
    "glm4_5_air_dapo": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 4096, "num_hidden_layers": 46,
        "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 1.0, "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": False,
        "num_nextn_predict_layers": 1, "vocab_size": 151552, "rope_theta": 1000000, "rms_norm_eps": 1e-5},
}


@pytest.mark.parametrize("recipe", sorted(MOE_MODELS))
def test_moe_recipes_layout_is_one_their_model_family_trains(recipe, tmp_path):
    """The launcher's pre-Ray check on the real model's shapes: the family accepts the recipe's tp / ep, refuses
    tensor parallelism (MoE training needs sequence parallelism there)."""
    import json

    from skyrl_mtp.models.families import ModelBuildError, family_for_config
    from skyrl_mtp.trainer.launch import check_parallel_layout

    ckpt = tmp_path / "model"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(MOE_MODELS[recipe]))
    overrides = [o for o in user_overrides(recipe, tmp_path) if not o.startswith("model.path=")]
    cfg = load_config([f"recipe={recipe}", *overrides, f"model.path={ckpt}"])
    assert family_for_config(MOE_MODELS[recipe]).declared_mtp_layers(MOE_MODELS[recipe]) == 1
    assert cfg.megatron.tp == 1 and cfg.megatron.ep > 1
    check_parallel_layout(cfg, ckpt)
    with pytest.raises(ModelBuildError, match="megatron.tp=2 with a"):
        check_parallel_layout(load_config([f"recipe={recipe}", *overrides, f"model.path={ckpt}", "megatron.tp=2",
                                           "megatron.dp=16"]), ckpt)


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
    assert policy.tp * policy.dp == cfg.trainer.placement.policy_num_workers
    assert policy.dtype == m.dtype and policy.micro_batch_size == m.micro_batch_size
    engine = engine_config(cfg, Path(cfg.model.path or tmp_path / "built_tiny_model"))  # tiny: built at launch
    assert engine.num_engines == cfg.generator.num_engines
    assert engine.tensor_parallel_size == cfg.generator.tensor_parallel_size


@pytest.mark.parametrize("key", ["pp", "cp"])
def test_pipeline_and_context_parallel_are_rejected_naming_the_key(key, tmp_path):
    overrides = user_overrides("mimo7b_dapo", tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(["recipe=mimo7b_dapo", *overrides, f"megatron.{key}=2", "megatron.dp=4"])
    msg = str(info.value)
    assert f"megatron.{key}=2 is invalid: only 1 is supported" in msg
    assert ("pipeline" if key == "pp" else "context") + " parallelism is not implemented" in msg
