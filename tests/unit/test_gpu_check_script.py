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
