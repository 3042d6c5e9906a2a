"""The console script: prints resolved recipes and rejects bad overrides before any work starts."""

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "skyrl_mtp.main", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cfg_job_prints_resolved_recipe_with_overrides():
    out = _cli("recipe=tiny_dapo", "trainer.mtp.num_speculative_tokens=3", "--cfg", "job")
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["trainer"]["mtp"]["num_speculative_tokens"] == 3
    assert "speculative_config" not in cfg["generator"] and "mtp_loss_type" not in cfg["megatron"]   # derived, not keys
    assert cfg["trainer"]["run_dir"] == "runs/tiny_dapo"


def test_bad_override_fails_with_named_key_and_nothing_written(tmp_path):
    run_dir = tmp_path / "run"
    out = _cli("recipe=tiny_dapo", "trainer.mtp.num_speculative_tokens=0", f"trainer.run_dir={run_dir}")
    assert out.returncode == 2
    assert "trainer.mtp.num_speculative_tokens=0 is invalid: must be >= 1" in out.stderr
    assert not run_dir.exists()


def test_help_lists_recipes():
    out = _cli("--help")
    assert out.returncode == 0 and "tiny_dapo" in out.stdout


def test_unknown_option():
    out = _cli("--frobnicate")
    assert out.returncode == 2 and "--frobnicate: unknown option" in out.stderr
