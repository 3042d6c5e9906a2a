"""Process environment for running vLLM, Megatron and Ray offline inside a work directory.

vLLM, torch.compile, Triton and the HF libraries all write caches under $HOME by default and
some try to reach a hub; both are wrong on CI machines and clusters with no network. Calling
`configure_offline_caches` once, before those libraries are imported, keeps every cache in one
directory and turns hub access and usage telemetry off.
"""

from __future__ import annotations

import os
from pathlib import Path

OFFLINE_FLAGS = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
}


def configure_offline_caches(cache_root: str | Path) -> dict[str, str]:
    """Point every library cache at `cache_root` and disable hub access; returns what was set.

    Variables the user already set are left alone, so a cluster's own cache layout wins.
    """
    root = Path(cache_root).resolve()
    dirs = {
        "XDG_CACHE_HOME": root / "xdg",
        "VLLM_CACHE_ROOT": root / "vllm",
        "TORCHINDUCTOR_CACHE_DIR": root / "inductor",
        "TRITON_CACHE_DIR": root / "triton",
        "HF_HOME": root / "hf",
        "WANDB_DIR": root / "wandb",
    }
    applied: dict[str, str] = {}
    for key, path in dirs.items():
        if key not in os.environ:
            path.mkdir(parents=True, exist_ok=True)
            os.environ[key] = str(path)
            applied[key] = str(path)
    for key, value in OFFLINE_FLAGS.items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    return applied
