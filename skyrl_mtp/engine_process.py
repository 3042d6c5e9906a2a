"""What the vLLM processes of one engine need from the run, as one object.

An engine actor builds vLLM, which starts its EngineCore process (and, with the multiprocessing executor,
worker processes) by itself. Code of this project runs in those processes (the worker extension, the
sampling and pipeline-parallel patches) and needs a few of the run's settings there. They travel as one
frozen `EngineProcessSettings`, serialised as JSON into one environment variable that the actor sets
before vLLM starts: every vLLM process inherits the environment, and part of that code runs at import,
before any vLLM config exists. Each process reads it with `current()`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields

ENV_VAR = "SKYRL_MTP_ENGINE_PROCESS"


@dataclass(frozen=True)
class EngineProcessSettings:
    cpu_sampling_fix: bool = True            # vllm_patches/cpu_sampling_fix.py (CPU workers)
    draft_invariant_sampling: bool = True    # vllm_patches/draft_invariant_sampling.py (CPU workers)
    pipeline_parallel_patch: bool = False    # vllm_patches/pipeline_parallel.py (engines with PP > 1, V1 runner)
    model_family: str | None = None          # the served family whose vLLM model code must be importable
    dflash_patches: bool = False             # vllm_patches/dflash_*.py (CPU engines drafting with DFlash)

    def to_env(self) -> dict[str, str]:
        return {ENV_VAR: json.dumps(asdict(self), sort_keys=True)}


def current() -> EngineProcessSettings:
    """This process's settings; the defaults outside an engine's processes (tests, scripts, the driver)."""
    raw = os.environ.get(ENV_VAR)
    if raw is None:
        return EngineProcessSettings()
    data = json.loads(raw)
    unknown = sorted(set(data) - {f.name for f in fields(EngineProcessSettings)})
    if unknown:
        raise ValueError(f"{ENV_VAR} has unknown fields {unknown}: the engine actor and its vLLM processes run "
                         "different versions of skyrl_mtp")
    return EngineProcessSettings(**data)
