"""A newcomer's mistakes, each refused by the command line before anything starts: exit status 2, one line naming
the key, the value and what is allowed, nothing written to the run dir, no model built and no Ray started.

The cases run `skyrl_mtp.main.main` in this process (the console script's own code, minus the interpreter start);
one case runs the console script as a subprocess to show the same line reaches a shell.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoint_stand_in import DAPO_ROW, stand_in_checkpoint

from skyrl_mtp.main import main

REPO = Path(__file__).resolve().parents[3]
PREFIX = "skyrl-mtp: invalid configuration: "
def refusal(capsys, tmp_path: Path, *args: str) -> str:
    """The one line the CLI prints for `args`, after checking exit status 2 and an untouched run dir."""
    run_dir = tmp_path / "run"
    assert main([*args, f"trainer.run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(PREFIX) and err.count("\n") == 1, err   # one problem, one line
    assert not run_dir.exists()
    return err[len(PREFIX):].strip()


def test_a_model_dir_without_tokenizer_files_is_refused(capsys, tmp_path):
    ckpt = stand_in_checkpoint(tmp_path / "m", tokenizer=False, chat_template=False)
    line = refusal(capsys, tmp_path, "recipe=tiny_dapo", f"model.path={ckpt}")
    assert line.startswith(f"model.path='{ckpt}' is invalid: has no tokenizer files (looked for ['tokenizer.json'")


def test_a_tokenizer_without_a_chat_template_is_refused(capsys, tmp_path):
    ckpt = stand_in_checkpoint(tmp_path / "m", chat_template=False)
    line = refusal(capsys, tmp_path, "recipe=tiny_dapo", f"model.path={ckpt}")
    assert line.startswith(f"model.path='{ckpt}' is invalid: its tokenizer has no chat template")


def test_warm_start_with_user_data_is_refused_before_ray(capsys, tmp_path):
    rows = tmp_path / "good.jsonl"
    rows.write_text(json.dumps(DAPO_ROW) + "\n")
    line = refusal(capsys, tmp_path, "recipe=tiny_dapo", "data.synthetic=null", f"data.train_files=[{rows}]")
    assert line.startswith("trainer.warm_start.enabled=True is invalid: must be false unless data.synthetic is set")


def test_a_moe_family_refuses_pipeline_stages_at_validation(capsys, tmp_path):
    line = refusal(capsys, tmp_path, "recipe=tiny_dapo", "model.tiny.family=deepseek_v3", "megatron.pp=2",
                   "trainer.placement.policy_num_workers=2")
    assert line.startswith("megatron.pp=2 is invalid: with a deepseek_v3 (MoE) model") and "allowed: pp=1" in line


def test_a_dense_family_refuses_expert_parallelism(capsys, tmp_path):
    line = refusal(capsys, tmp_path, "recipe=tiny_dapo", "megatron.ep=2", "megatron.dp=2",
                   "trainer.placement.policy_num_workers=2")
    assert line == "megatron.ep=2 is invalid: a mimo model has no routed experts to spread; allowed: 1"


def test_resume_never_on_a_used_run_dir_is_refused_and_the_run_is_left_as_it_was(capsys, tmp_path):
    run_dir = tmp_path / "used"
    (run_dir / "checkpoints" / "step_3").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_3" / "COMPLETE").write_text("3")
    assert main(["recipe=tiny_dapo", f"trainer.run_dir={run_dir}", "trainer.resume=never"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(PREFIX + f"trainer.run_dir='{run_dir}' is invalid: must not hold a run already when "
                                   "trainer.resume=never")
    assert sorted(p.name for p in run_dir.rglob("*")) == ["COMPLETE", "checkpoints", "step_3"]


def test_a_checkpoint_without_mtp_layers_is_refused_when_drafting_also_by_the_plan(capsys, tmp_path):
    ckpt = stand_in_checkpoint(tmp_path / "m", num_nextn_predict_layers=0)
    args = ["recipe=tiny_dapo", f"model.path={ckpt}", "trainer.mtp.num_speculative_tokens=3"]
    line = refusal(capsys, tmp_path, *args)
    assert line.startswith("trainer.drafter.kind='mtp' is invalid: cannot draft with the mimo model at model.path: it "
                           "has no MTP layers (num_nextn_predict_layers=0)")
    assert main([*args, "--cfg", "plan"]) == 2   # --cfg plan no longer says "fits"
    assert "num_nextn_predict_layers=0" in capsys.readouterr().err


def test_an_unknown_architecture_is_named_with_the_supported_ones(capsys, tmp_path):
    ckpt = stand_in_checkpoint(tmp_path / "m", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    line = refusal(capsys, tmp_path, "recipe=tiny_dapo", f"model.path={ckpt}")
    assert line.startswith(f"model.path='{ckpt}' is invalid: its config.json has architectures=['GPT2LMHeadModel'] "
                           "(model_type='gpt2'), which no model family reads; supported architectures: [")
    assert "'MiMoForCausalLM'" in line and "'Qwen3NextForCausalLM'" in line


@pytest.mark.parametrize("args, expected", [
    (["trainer.mtp.num_speculative_tokens=50"],
     "trainer.mtp.num_speculative_tokens=50 is invalid: an int in [1, 16]"),
    (["trainer.mtp.num_speculative_tokens=auto", "trainer.mtp.max_speculative_tokens=17"],
     "trainer.mtp.max_speculative_tokens=17 is invalid: an int in [1, 16]"),
    # settings that do nothing with a fixed k are refused alike
    (["trainer.mtp.max_speculative_tokens=5"],
     "trainer.mtp.max_speculative_tokens=5 is invalid: applies only with trainer.mtp.num_speculative_tokens=auto"),
    (["trainer.mtp.explore_budget=0.1"],
     "trainer.mtp.explore_budget=0.1 is invalid: applies only with trainer.mtp.num_speculative_tokens=auto"),
    (["trainer.mtp.idle_head_train_budget=0.5"],
     "trainer.mtp.idle_head_train_budget=0.5 is invalid: applies only with trainer.mtp.num_speculative_tokens=auto "
     "and train_depths=null"),
    # OmegaConf's type errors, rephrased with the key and the expected form
    (["data.train_files=/path"],
     "data.train_files='/path' is invalid: must be a list: write data.train_files=[a,b]"),
    (["trainer.total_steps=ten"], "trainer.total_steps='ten' is invalid: must be an integer, e.g. 10"),
    (["generator.engine_kwargs=3"], "generator.engine_kwargs=3 is invalid: must be a mapping"),
    # the tp / policy_num_workers pair: the message says both change together
    (["megatron.tp=2"], "trainer.placement.policy_num_workers=1 is invalid: must equal the policy's parallel layout "
                        "megatron.tp*pp*cp*dp = 2*1*1*1 = 2 (one worker per Megatron rank): a change of the layout "
                        "changes both, e.g. trainer.placement.policy_num_workers=2 with megatron.tp=2"),
    # the engines' refusals of extra vLLM arguments, made before they start
    (["generator.engine_kwargs.max_model_len=64"],
     "generator.engine_kwargs={'max_model_len': 64} is invalid: keys ['max_model_len'] are set by the project"),
])
def test_tiny_recipe_refusals(capsys, tmp_path, args, expected):
    assert refusal(capsys, tmp_path, "recipe=tiny_dapo", *args).startswith(expected)


def test_a_search_recipe_with_the_math_environment_is_refused(capsys, tmp_path):
    line = refusal(capsys, tmp_path, "recipe=tiny_searchr1", "environment.name=math")
    assert line.startswith("environment.name='math' is invalid: must be 'search' with data.synthetic='search'")


def test_a_data_file_in_the_wrong_layout_names_the_file_and_the_field(capsys, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "who?", "golden_answers": ["a"]}) + "\n")   # Search-R1, not DAPO
    line = refusal(capsys, tmp_path, "recipe=tiny_dapo", "data.synthetic=null", "trainer.warm_start.enabled=false",
                   f"data.train_files=[{rows}]")
    assert line.startswith(f"data.train_files[0]='{rows}' is invalid: must hold rows in the dapo layout "
                           "(docs/data.md): row 0: field 'prompt' must be a non-empty list")


def test_the_console_script_prints_the_same_one_line(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "skyrl_mtp.main", "recipe=tiny_dapo", "trainer.total_steps=ten",
                          f"trainer.run_dir={run_dir}"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr == PREFIX + "trainer.total_steps='ten' is invalid: must be an integer, e.g. 10\n"
    assert not run_dir.exists()
