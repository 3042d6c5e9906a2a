"""Shared fixtures: offline caches, GPU skipping, one Ray local cluster and one tiny checkpoint per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from skyrl_mtp.runtime_env import configure_offline_caches

REPO_ROOT = Path(__file__).resolve().parents[1]
configure_offline_caches(os.environ.get("SKYRL_MTP_CACHE", REPO_ROOT / ".cache"))


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; the CPU path is covered by the non-gpu tests")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ray_local():
    """A Ray local cluster shared by every integration test of the session."""
    ray = pytest.importorskip("ray")   # only a lent GPU machine may lack it (scripts/gpu_check.sh)

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The default tiny MiMo-architecture checkpoint (random trunk, random MTP head)."""
    from skyrl_mtp.models.tiny import TinyModelSpec, build_tiny_checkpoint

    out = tmp_path_factory.mktemp("tiny_ckpt")
    return build_tiny_checkpoint(out, TinyModelSpec(seed=0))
