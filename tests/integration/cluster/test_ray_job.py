"""`skyrl_mtp.cluster.submit` against a real Ray head on loopback (token auth on, private temp dir).

The fast tests prove the mechanics with trivial entrypoints (upload, env vars, exit codes, auth,
local validation); the slow one runs the tiny recipe for two RL steps as a job and reads its
metrics file.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from skyrl_mtp.cluster.job_spec import EXIT_CLUSTER, EXIT_CONFIG, parse_submit_args
from skyrl_mtp.cluster.submit import main, run_job

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]


def _args(head, *extra: str, token_file: Path | None = None):
    argv = ["--address", head.dashboard_url, "--working-dir", str(REPO),
            "--auth-token-file", str(token_file or head.token_file), *extra, "--", "recipe=tiny_dapo"]
    return parse_submit_args(argv, environ={})


def _jobs(head) -> list:
    from ray.job_submission import JobSubmissionClient

    token = head.token_file.read_text().strip()
    return JobSubmissionClient(head.dashboard_url, headers={"Authorization": f"Bearer {token}"}).list_jobs()


def test_trivial_job_sees_uploaded_code_and_env(ray_head, tmp_path):
    out = tmp_path / "job_out.json"
    script = ("import json, os, sys; import skyrl_mtp.cluster.job_spec as m; "
              "json.dump({'module': m.__file__, 'cwd': os.getcwd(), 'greeting': os.environ.get('GREETING'), "
              "'hf_offline': os.environ.get('HF_HUB_OFFLINE'), 'python': sys.executable}, "
              "open(os.environ['OUT'], 'w'))")
    args = _args(ray_head, "--env", "GREETING=hello cluster", "--env", f"OUT={out}")
    rc = run_job(args, f"python -c {shlex.quote(script)}")
    assert rc == 0
    seen = json.loads(out.read_text())
    assert seen["greeting"] == "hello cluster"
    assert seen["hf_offline"] == "1"
    # the code came from the uploaded working dir (a copy under the head's temp dir), not from the checkout
    assert seen["module"].startswith(str(ray_head.temp_dir))
    assert seen["cwd"].startswith(str(ray_head.temp_dir))
    assert Path(seen["python"]).parent == ray_head.python_bin


def test_failed_job_returns_its_exit_code(ray_head, capsys):
    rc = run_job(_args(ray_head), "python -c 'import sys; print(\"about to fail\"); sys.exit(7)'")
    assert rc == 7
    captured = capsys.readouterr()
    assert "about to fail" in captured.out
    assert "FAILED (exit code 7)" in captured.err


def test_wrong_token_is_refused_before_anything_runs(ray_head, tmp_path, capsys):
    wrong = tmp_path / "wrong_token"
    wrong.write_text("0" * 64)
    before = len(_jobs(ray_head))
    rc = run_job(_args(ray_head, token_file=wrong), "python -c 'print(1)'")
    assert rc == EXIT_CLUSTER
    assert "could not submit" in capsys.readouterr().err
    assert len(_jobs(ray_head)) == before


def test_bad_override_fails_locally_and_submits_nothing(ray_head, capsys):
    before = len(_jobs(ray_head))
    rc = main(["--address", ray_head.dashboard_url, "--working-dir", str(REPO),
               "--auth-token-file", str(ray_head.token_file), "--",
               "recipe=tiny_dapo", "trainer.mtp.num_speculative_tokens=0"])
    assert rc == EXIT_CONFIG
    assert "trainer.mtp.num_speculative_tokens=0 is invalid: must be >= 1" in capsys.readouterr().err
    assert len(_jobs(ray_head)) == before


@pytest.mark.slow
def test_tiny_recipe_runs_two_steps_as_a_job(ray_head, tmp_path, capsys):
    run_dir = tmp_path / "run"
    cache = os.environ.get("SKYRL_MTP_CACHE", str(REPO / ".cache"))
    rc = main(["--address", ray_head.dashboard_url, "--working-dir", str(REPO),
               "--auth-token-file", str(ray_head.token_file), "--env", f"SKYRL_MTP_CACHE={cache}", "--",
               "recipe=tiny_dapo", "trainer.total_steps=2", f"trainer.run_dir={run_dir}",
               "trainer.eval_every_n_steps=0", "trainer.checkpoint.every_n_steps=0", "trainer.progress_bar=false",
               "logger.backends=[console,jsonl]"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    assert "SUCCEEDED (exit code 0)" in captured.err
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("reward/mean" in r for r in rows)
