"""Run a recipe on a Ray cluster as a Ray job: validate locally, submit, stream logs, exit with its status.

    skyrl-mtp-submit --address http://HEAD:8265 [--env K=V ...] [--no-wait] \\
        -- recipe=NAME key=value ...

The config is composed and validated here first, exactly as the job will compose it (same recipe
search from the working dir), so a typo or an impossible setting fails in a second instead of after
an upload and a cluster-side start-up. Ray 2.60 clusters use token auth by default and the job SDK
does not send the token on its own unless this shell is in token mode, so the token (from
--auth-token-file, $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) is sent explicitly.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from skyrl_mtp.cluster.job_spec import (
    EXIT_CLUSTER,
    EXIT_CONFIG,
    SubmitArgs,
    SubmitError,
    auth_headers,
    build_entrypoint,
    build_runtime_env,
    check_recipe_uploaded,
    exit_code_for,
    parse_submit_args,
    path_problem,
    relocate_recipe_dir,
    resolve_auth_token,
    run_dir_warning,
)
from skyrl_mtp.errors import ConfigError

PROG = "skyrl-mtp-submit"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def _say(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def validate_locally(args: SubmitArgs) -> list[str]:
    """Compose + validate the config as the job will (from the working dir). Returns warnings.

    Raises ConfigError (invalid config) or SubmitError (the job could not see the recipe).
    """
    from skyrl_mtp.config import compose_config, load_config
    from skyrl_mtp.config.loader import _split_overrides, available_recipes, recipe_dirs

    warnings: list[str] = []
    with _cwd(args.working_dir):
        cli, _ = _split_overrides(args.overrides)
        recipes = available_recipes(recipe_dirs(cli.get("recipe_dir")))
        if cli.get("recipe") in recipes:
            check_recipe_uploaded(recipes[cli["recipe"]], args.working_dir)
        try:
            cfg = load_config(args.overrides)
        except ConfigError as err:
            blocking = [p for p in err.problems if not (args.skip_path_checks and path_problem(p))]
            if blocking:
                raise ConfigError(blocking) from None
            warnings += [f"not checked locally (--skip-path-checks): {p}" for p in err.problems]
            cfg = compose_config(args.overrides)
    warning = run_dir_warning(str(cfg.trainer.run_dir))
    if warning:
        warnings.append(warning)
    return warnings


def _client(args: SubmitArgs):
    from ray.job_submission import JobSubmissionClient

    token, source = resolve_auth_token(args.auth_token_file, os.environ, Path.home())
    _say(f"auth token: {source if token else 'none (' + source + ')'}")
    return JobSubmissionClient(args.address, headers=auth_headers(token))


async def _stream_logs(client, job_id: str) -> None:
    async for chunk in client.tail_job_logs(job_id):
        print(chunk, end="", flush=True)


def wait_for_terminal(client, job_id: str, timeout_s: float = 120.0, poll_s: float = 1.0) -> str:
    """Status once the job has ended (the log stream can close a moment before the status flips)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = str(client.get_job_status(job_id).value)
        if status in TERMINAL or time.monotonic() > deadline:
            return status
        time.sleep(poll_s)


def follow(client, job_id: str, address: str) -> int:
    """Stream the job's logs until it ends; return its exit code (0 only for SUCCEEDED)."""
    try:
        try:
            asyncio.run(_stream_logs(client, job_id))
        except KeyboardInterrupt:
            raise
        except Exception as err:  # noqa: BLE001 - a broken log stream must not lose the job's status
            _say(f"log streaming stopped ({type(err).__name__}: {err}); polling the job status instead")
        status = wait_for_terminal(client, job_id, timeout_s=float("inf"))
    except KeyboardInterrupt:
        _say(f"interrupted; the job keeps running. Follow it with `ray job logs -f {job_id} --address "
             f"{address}` or stop it with `ray job stop {job_id} --address {address}`")
        return 130
    info = client.get_job_info(job_id)
    code = exit_code_for(status, info.driver_exit_code)
    detail = f": {info.message}" if status != "SUCCEEDED" and info.message else ""
    _say(f"job {job_id} {status} (exit code {code}){detail.splitlines()[0] if detail else ''}")
    return code


def submit(args: SubmitArgs) -> int:
    try:
        for warning in validate_locally(args):
            _say(warning)
        overrides = relocate_recipe_dir(args.overrides, args.working_dir)
    except SubmitError as err:
        _say(str(err))
        return EXIT_CONFIG
    except ConfigError as err:
        _say(str(err))
        return EXIT_CONFIG
    recipe = next(o.partition("=")[2] for o in overrides if o.startswith("recipe="))
    return run_job(args, build_entrypoint(args.python, overrides), {"skyrl_mtp_recipe": recipe})


# A head that has just started answers HTTP before its job agent is registered.
_AGENT_NOT_READY = "No available agent to submit job"


def submit_with_retry(submit_once, timeout_s: float = 90.0, poll_s: float = 2.0):
    """`submit_once()`, retried while the cluster says its job agent is not ready yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return submit_once()
        except RuntimeError as err:
            if _AGENT_NOT_READY not in str(err) or time.monotonic() > deadline:
                raise
            _say("the cluster's job agent is not ready yet; retrying")
            time.sleep(poll_s)


def run_job(args: SubmitArgs, entrypoint: str, metadata: dict[str, str] | None = None) -> int:
    """Submit `entrypoint` with the runtime env of `args`; follow it unless --no-wait. Returns the exit code."""
    runtime_env = build_runtime_env(args)
    try:
        client = _client(args)
        job_id = submit_with_retry(lambda: client.submit_job(
            entrypoint=entrypoint, runtime_env=runtime_env, submission_id=args.submission_id,
            metadata=metadata or {}))
    except SubmitError as err:
        _say(str(err))
        return EXIT_CONFIG
    except Exception as err:  # noqa: BLE001 - connection, auth and HTTP errors come in many types
        _say(f"could not submit to {args.address}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        if "401" in str(err) or "Authentication" in type(err).__name__ + str(err):
            _say("the cluster requires its token: pass --auth-token-file FILE (the head's ~/.ray/auth_token) "
                 "or set RAY_AUTH_TOKEN")
        return EXIT_CLUSTER
    _say(f"submitted job {job_id}: {entrypoint}")
    if not args.wait:
        _say(f"not waiting; follow with `ray job logs -f {job_id} --address {args.address}`")
        return 0
    return follow(client, job_id, args.address)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_submit_args(argv)
    except SubmitError as err:
        _say(str(err))
        return EXIT_CONFIG
    return submit(args)


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
