"""Every check the launcher or the workers make on a config value is also made by validation, first.

Each case below is a config that one of those run-time checks refuses (the check is called here on the composed,
unvalidated config, to show the case is real: `launch.py`'s warm start and data loading, the engines'
EngineConfig, `check_checkpoint` and engine-argument checks, the model family's layout check the policy makes
when it builds the model) and must be refused by `validate_config` naming the same key, before anything starts.
The checks were found by going through trainer/launch.py, rollout/config.py, rollout/client.py,
rollout/engine.py, models/families and policy/config.py; PolicyWorkerConfig's own range checks repeat ranges
validation already checks (tests/unit/config/test_validation.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from checkpoint_stand_in import DAPO_ROW, stand_in_checkpoint

from skyrl_mtp.config import ConfigError, compose_config, validate_config
from skyrl_mtp.models.families import ModelBuildError


def _layout(cfg):   # what policy/megatron builds check before any distributed set-up (the family's rule)
    from skyrl_mtp.config.memory_plan import run_hf_config
    from skyrl_mtp.models.families import family_for_config

    hf = run_hf_config(cfg)
    family = family_for_config(hf)
    family.check_parallel(family.args_from_config(hf), tp=cfg.megatron.tp, ep=cfg.megatron.ep, pp=cfg.megatron.pp)


def _engine(cfg):   # the engines' config as the launcher builds it, then EngineClient.create's file checks
    from skyrl_mtp.rollout.config import check_checkpoint
    from skyrl_mtp.trainer.run_plan import engine_config

    check_checkpoint(engine_config(cfg, cfg.model.path or "/model"))


def _engine_args(cfg):   # EngineClient.create: every extra argument is a vLLM engine argument
    from skyrl_mtp.rollout.client import known_engine_args
    from skyrl_mtp.rollout.config import check_engine_kwargs_known
    from skyrl_mtp.trainer.run_plan import engine_config

    check_engine_kwargs_known(engine_config(cfg, "/model").engine_kwargs, known_engine_args())


def _family_engine_args(cfg):   # the engine actor: what the model's family needs from vLLM on CPU
    from skyrl_mtp.models.families import engine_kwargs_for_family, family_by_name

    kwargs = dict(cfg.generator.engine_kwargs)
    engine_kwargs_for_family(family_by_name(cfg.model.tiny.family), {}, kwargs, on_cpu=True)


def _warm_start(cfg):
    from skyrl_mtp.trainer.launch import warm_start_examples
    from skyrl_mtp.trainer.run_plan import build_run_plan

    warm_start_examples(build_run_plan(cfg), {}, SimpleNamespace(eos_token_id=0))


def _load_data(cfg):
    from skyrl_mtp.trainer.launch import load_examples
    from skyrl_mtp.trainer.run_plan import build_run_plan

    load_examples(build_run_plan(cfg), [Path(p) for p in cfg.data.train_files], None, "train")


def _search_rows(tmp: Path) -> Path:
    path = tmp / "search.jsonl"
    path.write_text(json.dumps({"question": "who?", "golden_answers": ["a"]}) + "\n")
    return path


def _dapo_rows(tmp: Path) -> Path:
    path = tmp / "dapo.jsonl"
    path.write_text(json.dumps(DAPO_ROW) + "\n")
    return path


# (name, overrides of recipe=tiny_dapo given the tmp dir, the run-time check, what it raises, the key validation names)
CASES = [
    ("moe_pipeline", lambda t: ["model.tiny.family=deepseek_v3", "megatron.pp=2",
                                "trainer.placement.policy_num_workers=2"], _layout, ModelBuildError, "megatron.pp"),
    ("moe_tensor_parallel", lambda t: ["model.tiny.family=glm4_moe", "megatron.tp=2",
                                       "trainer.placement.policy_num_workers=2"], _layout, ModelBuildError,
     "megatron.tp"),
    ("dense_expert_parallel", lambda t: ["megatron.ep=2", "megatron.dp=2", "trainer.placement.policy_num_workers=2"],
     _layout, ModelBuildError, "megatron.ep"),
    ("no_mtp_layers", lambda t: [f"model.path={stand_in_checkpoint(t / 'm', num_nextn_predict_layers=0)}"],
     _engine, ValueError, "trainer.drafter.kind"),
    ("no_weights", lambda t: [f"model.path={_without_weights(stand_in_checkpoint(t / 'm'))}"],
     _engine, ValueError, "model.path"),
    ("managed_engine_arg", lambda t: ["generator.engine_kwargs.max_num_seqs=4"], _engine, ValueError,
     "generator.engine_kwargs"),
    ("project_additional_config", lambda t: ["+generator.engine_kwargs.additional_config.skyrl_mtp_k=1"], _engine,
     ValueError, "generator.engine_kwargs"),
    ("unknown_engine_arg", lambda t: ["generator.engine_kwargs.swap_space=1"], _engine_args, ValueError,
     "generator.engine_kwargs"),
    ("family_engine_arg", lambda t: ["model.tiny.family=deepseek_v3",
                                     "generator.engine_kwargs.compilation_config={custom_ops:[all]}"],
     _family_engine_args, ModelBuildError, "generator.engine_kwargs"),
    ("warm_start_on_user_data", lambda t: ["data.synthetic=null", f"data.train_files=[{_dapo_rows(t)}]"],
     _warm_start, ConfigError, "trainer.warm_start.enabled"),
    ("data_layout", lambda t: ["data.synthetic=null", "trainer.warm_start.enabled=false",
                               f"data.train_files=[{_search_rows(t)}]"], _load_data, ConfigError,
     "data.train_files[0]"),
]


def _without_weights(ckpt: Path) -> Path:
    (ckpt / "model.safetensors").unlink()
    return ckpt


@pytest.mark.parametrize("name, overrides, runtime_check, raises, key", CASES, ids=[c[0] for c in CASES])
def test_a_runtime_refusal_is_a_validation_refusal(name, overrides, runtime_check, raises, key, tmp_path):
    cfg = compose_config(["recipe=tiny_dapo", *overrides(tmp_path)])
    with pytest.raises(raises):
        runtime_check(cfg)   # the case is one the run would refuse
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert any(p.startswith(f"{key}=") for p in info.value.problems), info.value.problems
