"""The pure parts of job submission: arguments, runtime env, entrypoint, auth token, exit codes, local checks."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from skyrl_mtp.cluster.job_spec import (
    DEFAULT_EXCLUDES,
    SubmitError,
    auth_headers,
    build_entrypoint,
    build_runtime_env,
    check_recipe_uploaded,
    exit_code_for,
    parse_env_args,
    parse_submit_args,
    path_problem,
    relocate_recipe_dir,
    resolve_auth_token,
    run_dir_warning,
)
from skyrl_mtp.cluster.submit import main, validate_locally
from skyrl_mtp.config import ConfigError

REPO = Path(__file__).resolve().parents[3]
ADDR = ["--address", "http://127.0.0.1:8265", "--working-dir", str(REPO)]


def _parse(*argv: str, environ=None):
    return parse_submit_args(list(argv), environ={} if environ is None else environ)


def test_parse_splits_options_and_overrides():
    args = _parse(*ADDR, "--env", "A=1", "--env", "B=x=y", "--no-wait", "--", "recipe=tiny_dapo", "trainer.total_steps=2")
    assert args.address == "http://127.0.0.1:8265"
    assert args.working_dir == REPO
    assert args.overrides == ["recipe=tiny_dapo", "trainer.total_steps=2"]
    assert args.env == {"A": "1", "B": "x=y"}
    assert args.wait is False
    assert args.python == "python"


def test_address_from_environment_and_trailing_slash():
    args = _parse("--working-dir", str(REPO), "--", "recipe=tiny_dapo",
                  environ={"RAY_API_SERVER_ADDRESS": "http://head:8265/"})
    assert args.address == "http://head:8265"


@pytest.mark.parametrize("argv, message", [
    (["--working-dir", str(REPO), "--", "recipe=tiny_dapo"], "--address is required"),
    (["--address", "ray://head:10001", "--working-dir", str(REPO), "--", "recipe=x"], "is a Ray Client address"),
    (["--address", "head:6379", "--working-dir", str(REPO), "--", "recipe=x"], "must be the dashboard URL"),
    ([*ADDR, "--", "trainer.total_steps=2"], "no recipe given"),
    ([*ADDR, "--", "recipe=tiny_dapo", "--cfg"], "options go before `--`"),
    (["--address", "http://h:8265", "--working-dir", "/nonexistent/dir", "--", "recipe=x"], "is not a directory"),
    ([*ADDR, "--env", "1BAD=x", "--", "recipe=x"], "the name must be letters"),
])
def test_parse_errors_name_the_argument(argv, message):
    with pytest.raises(SubmitError, match=message.replace("(", r"\(").replace("`", "`")):
        _parse(*argv)


def test_working_dir_must_be_the_repository(tmp_path):
    with pytest.raises(SubmitError, match="has no skyrl_mtp/main.py"):
        _parse("--address", "http://h:8265", "--working-dir", str(tmp_path), "--", "recipe=x")


def test_bare_env_name_copies_from_shell_or_fails():
    assert parse_env_args(["WANDB_API_KEY"], {"WANDB_API_KEY": "k"}) == {"WANDB_API_KEY": "k"}
    with pytest.raises(SubmitError, match="--env WANDB_API_KEY: not set in this shell"):
        parse_env_args(["WANDB_API_KEY"], {})


def test_runtime_env_offline_by_default_user_values_win():
    args = _parse(*ADDR, "--env", "WANDB_MODE=online", "--env", "FOO=bar", "--exclude", "data/big", "--",
                  "recipe=tiny_dapo")
    env = build_runtime_env(args)
    assert env["working_dir"] == str(REPO)
    assert env["env_vars"]["HF_HUB_OFFLINE"] == "1"
    assert env["env_vars"]["VLLM_NO_USAGE_STATS"] == "1"
    assert env["env_vars"]["WANDB_MODE"] == "online"
    assert env["env_vars"]["FOO"] == "bar"
    for pattern in (".venv", ".cache", "runs", "wandb", ".git", "data/big"):
        assert pattern in env["excludes"]
    assert env["excludes"][:len(DEFAULT_EXCLUDES)] == list(DEFAULT_EXCLUDES)


def test_entrypoint_quotes_overrides_for_the_shell():
    cmd = build_entrypoint("python", ["recipe=tiny_dapo", "data.train_files=[/a b/x.parquet,/c.parquet]",
                                      "logger.run_name=it's"])
    assert cmd.startswith("python -m skyrl_mtp.main ")
    assert shlex.split(cmd) == ["python", "-m", "skyrl_mtp.main", "recipe=tiny_dapo",
                                "data.train_files=[/a b/x.parquet,/c.parquet]", "logger.run_name=it's"]


def test_recipe_dir_is_made_relative_or_rejected(tmp_path):
    inside = REPO / "recipes"
    assert relocate_recipe_dir(["recipe=a", f"recipe_dir={inside}"], REPO) == ["recipe=a", "recipe_dir=recipes"]
    with pytest.raises(SubmitError, match="is outside --working-dir"):
        relocate_recipe_dir([f"recipe_dir={tmp_path}"], REPO)
    with pytest.raises(SubmitError, match="outside --working-dir"):
        check_recipe_uploaded(tmp_path / "mine.yaml", REPO)
    check_recipe_uploaded(REPO / "recipes" / "tiny_dapo.yaml", REPO)


def test_auth_token_sources_in_order(tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("fromhome\n")
    path_file = tmp_path / "tok"
    path_file.write_text("frompath")
    explicit = tmp_path / "explicit"
    explicit.write_text("fromexplicit")
    env = {"RAY_AUTH_TOKEN": "fromenv", "RAY_AUTH_TOKEN_PATH": str(path_file)}
    assert resolve_auth_token(explicit, env, home)[0] == "fromexplicit"
    assert resolve_auth_token(None, env, home)[0] == "fromenv"
    assert resolve_auth_token(None, {"RAY_AUTH_TOKEN_PATH": str(path_file)}, home)[0] == "frompath"
    assert resolve_auth_token(None, {}, home) == ("fromhome", str(home / ".ray" / "auth_token"))
    assert resolve_auth_token(None, {}, tmp_path / "nohome")[0] is None
    assert auth_headers("abc") == {"Authorization": "Bearer abc"}
    assert auth_headers(None) == {}


def test_auth_token_errors(tmp_path):
    with pytest.raises(SubmitError, match="--auth-token-file='.*missing' does not exist"):
        resolve_auth_token(tmp_path / "missing", {}, tmp_path)
    with pytest.raises(SubmitError, match="RAY_AUTH_TOKEN_PATH='.*nope' does not exist"):
        resolve_auth_token(None, {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "nope")}, tmp_path)
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(SubmitError, match="is empty"):
        resolve_auth_token(empty, {}, tmp_path)


@pytest.mark.parametrize("status, code, expected", [
    ("SUCCEEDED", 0, 0), ("SUCCEEDED", None, 0), ("FAILED", 7, 7), ("FAILED", None, 1), ("FAILED", 0, 1),
    ("STOPPED", None, 1),
])
def test_exit_code_mapping(status, code, expected):
    assert exit_code_for(status, code) == expected


def test_path_problems_and_run_dir_warning():
    assert path_problem("model.path='/x' is invalid: path does not exist")
    assert path_problem("model.path='/x' is invalid: directory has no config.json (expected an HF checkpoint)")
    assert not path_problem("trainer.total_steps=0 is invalid: must be >= 1")
    assert "is relative" in run_dir_warning("runs/x")
    assert run_dir_warning("/shared/runs/x") is None


def test_local_validation_rejects_bad_override():
    args = _parse(*ADDR, "--", "recipe=tiny_dapo", "trainer.mtp.loss_type=kl")
    with pytest.raises(ConfigError, match="trainer.mtp.loss_type='kl' is invalid"):
        validate_locally(args)


def test_local_validation_path_checks_can_be_deferred_to_the_cluster(tmp_path):
    overrides = ["recipe=tiny_dapo", "model.path=/only/on/the/cluster", f"trainer.run_dir={tmp_path}/run"]
    with pytest.raises(ConfigError, match="model.path='/only/on/the/cluster' is invalid: path does not exist"):
        validate_locally(_parse(*ADDR, "--", *overrides))
    warnings = validate_locally(_parse(*ADDR, "--skip-path-checks", "--", *overrides))
    assert any("not checked locally" in w and "/only/on/the/cluster" in w for w in warnings)
    # other problems still block
    with pytest.raises(ConfigError, match="trainer.total_steps=0"):
        validate_locally(_parse(*ADDR, "--skip-path-checks", "--", *overrides, "trainer.total_steps=0"))


def test_relative_run_dir_is_warned_about():
    warnings = validate_locally(_parse(*ADDR, "--", "recipe=tiny_dapo"))
    assert any("trainer.run_dir='runs/tiny_dapo' is relative" in w for w in warnings)


def test_main_returns_2_and_submits_nothing_on_bad_config(capsys):
    # the address is unreachable: reaching the submission step would give exit code 3, not 2
    rc = main(["--address", "http://127.0.0.1:9", "--working-dir", str(REPO), "--", "recipe=no_such_recipe"])
    assert rc == 2
    assert "recipe='no_such_recipe' is invalid: no such recipe" in capsys.readouterr().err


def test_main_returns_3_when_cluster_unreachable(capsys, tmp_path):
    rc = main(["--address", "http://127.0.0.1:9", "--working-dir", str(REPO), "--auth-token-file",
               str(_token(tmp_path)), "--", "recipe=tiny_dapo", f"trainer.run_dir={tmp_path}/run"])
    assert rc == 3
    assert "could not submit to http://127.0.0.1:9" in capsys.readouterr().err


def _token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("t" * 32)
    return path


class _FakeStatus:
    def __init__(self, value):
        self.value = value


class _FakeInfo:
    def __init__(self, code, message):
        self.driver_exit_code, self.message = code, message


class _FakeClient:
    """Stands in for JobSubmissionClient: a log stream, then statuses in order, then the final info."""

    def __init__(self, chunks, statuses, code=None, message="", stream_error=None):
        self.chunks, self.statuses, self.info = chunks, list(statuses), _FakeInfo(code, message)
        self.stream_error = stream_error

    async def tail_job_logs(self, job_id):
        for c in self.chunks:
            yield c
        if self.stream_error:
            raise self.stream_error

    def get_job_status(self, job_id):
        return _FakeStatus(self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0])

    def get_job_info(self, job_id):
        return self.info


def test_follow_streams_logs_and_returns_the_job_exit_code(capsys):
    from skyrl_mtp.cluster.submit import follow

    client = _FakeClient(["step 1\n", "step 2\n"], ["RUNNING", "FAILED"], code=5, message="exit code 5\nmore")
    assert follow(client, "job1", "http://h:8265") == 5
    out = capsys.readouterr()
    assert out.out == "step 1\nstep 2\n"
    assert "job job1 FAILED (exit code 5): exit code 5" in out.err


def test_follow_survives_a_broken_log_stream(capsys):
    from skyrl_mtp.cluster.submit import follow

    client = _FakeClient(["partial\n"], ["SUCCEEDED"], stream_error=ConnectionResetError("gone"))
    assert follow(client, "job2", "http://h:8265") == 0
    assert "log streaming stopped (ConnectionResetError: gone); polling the job status instead" in capsys.readouterr().err


def test_submit_retries_only_while_the_job_agent_is_not_ready():
    from skyrl_mtp.cluster.submit import submit_with_retry

    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("Request failed with status code 500: No available agent to submit job, please try again later.")
        return "raysubmit_1"

    assert submit_with_retry(flaky, poll_s=0.0) == "raysubmit_1" and len(calls) == 3

    def broken():
        raise RuntimeError("Request failed with status code 500: something else")

    with pytest.raises(RuntimeError, match="something else"):
        submit_with_retry(broken, poll_s=0.0)
