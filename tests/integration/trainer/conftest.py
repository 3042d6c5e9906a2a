"""Run the CLI in a subprocess, as `make run` does (each run owns its Ray session)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


# vLLM and Ray pick a free port, close it and bind it later: a run started beside another can lose that race
PORT_RACE = ("EADDRINUSE", "Address already in use")


def run_cli(args: list[str], env_extra: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    """One CLI run; a start-up that lost a port race to a run beside it is run once more."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    env.pop("RAY_ADDRESS", None)
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-m", "skyrl_mtp.main", *args], cwd=REPO, env=env, text=True,
                              capture_output=True, timeout=timeout)
        if proc.returncode == 0 or not any(p in proc.stderr for p in PORT_RACE):
            break
    return proc


@pytest.fixture(scope="session")
def cli():
    return run_cli
