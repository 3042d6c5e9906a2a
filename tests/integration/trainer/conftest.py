"""Run the CLI in a subprocess, as `make run` does (each run owns its Ray session)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def run_cli(args: list[str], env_extra: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "skyrl_mtp.main", *args], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=timeout)


@pytest.fixture(scope="session")
def cli():
    return run_cli
