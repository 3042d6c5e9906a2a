"""scripts/gpu_check.sh, the one prepared GPU check, as far as a CPU machine can run it: it starts, finds no
GPU, says so and exits 3 without writing anything beside its output folder (on a GPU it runs tests/gpu and
benchmarks/train_step_gpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs the whole check")
def test_without_a_gpu_it_says_so_and_exits_3(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out)], cwd=REPO, text=True,
                          capture_output=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 3, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text()
    assert "no CUDA GPU found by torch" in summary and "nothing to check here" in summary
    assert sorted(p.name for p in out.iterdir()) == ["summary.txt"]


# what the lent GPU machine lacks (measured 2026-12-04: it has torch, transformers, safetensors, tokenizers, numpy,
# scipy, pytest), by import name; scripts/gpu_check.sh carries some as wheels
GPU_MACHINE_LACKS = ("ray", "vllm", "wandb", "math_verify", "datasets", "fastapi", "uvicorn", "bm25s", "hydra",
                     "omegaconf", "megatron")
IMPORT_NAMES = {"megatron-core": "megatron", "hydra-core": "hydra", "antlr4-python3-runtime": "antlr4"}


def carried_packages() -> set[str]:
    """Import names of the wheels scripts/gpu_check.sh carries (its PACKAGES array)."""
    import re

    text = (REPO / "scripts" / "gpu_check.sh").read_text()
    (body,) = re.findall(r"^PACKAGES=\((.*)\)$", text, flags=re.M)
    dists = [p.split("==")[0] for p in body.split()]
    return {IMPORT_NAMES.get(d, d.replace("-", "_")) for d in dists}


def _without(blocked: list[str], *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "gpu")])}
    return subprocess.run([sys.executable, str(REPO / "tests" / "unit" / "without_modules.py"), ",".join(blocked),
                           *args], cwd=REPO, text=True, capture_output=True, timeout=timeout, env=env)


def test_the_gpu_checks_imports_and_fixtures_need_nothing_the_gpu_machine_lacks(tmp_path):
    carried = carried_packages()
    assert {"megatron", "hydra", "omegaconf", "bm25s"} <= carried
    blocked = [m for m in GPU_MACHINE_LACKS if m not in carried]
    assert blocked == ["ray", "vllm", "wandb", "math_verify", "datasets", "fastapi", "uvicorn"]
    # the stand-in works: a blocked package does not import
    probe = _without(blocked, "-c", "import importlib.util, sys\ntry:\n    import ray\nexcept ModuleNotFoundError:\n"
                                    "    sys.exit(7)")
    assert probe.returncode == 7, probe.stderr
    # what `pytest tests/gpu` imports to collect its tests
    collect = _without(blocked, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu")
    assert collect.returncode == 0 and "9 tests collected" in collect.stdout, collect.stdout + collect.stderr
    # the tiny_ckpt fixture's path, the GPU policy rank's imports, and benchmarks/train_step_gpu.py end to end
    # (--quick: the same code on the CPU)
    code = (f"from skyrl_mtp.models.tiny import TinyModelSpec, build_tiny_checkpoint\n"
            f"build_tiny_checkpoint({str(tmp_path / 'ckpt')!r}, TinyModelSpec(seed=0))\n"
            "import policy_gpu_rank, skyrl_mtp.policy.synthetic_batch\n"
            "import runpy, sys\n"
            f"sys.argv = ['train_step_gpu.py', '--quick', '--json', {str(tmp_path / 'bench.json')!r}]\n"
            "runpy.run_path('benchmarks/train_step_gpu.py', run_name='__main__')\n")
    run = _without(blocked, "-c", code)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (tmp_path / "ckpt" / "config.json").is_file() and (tmp_path / "bench.json").is_file()
