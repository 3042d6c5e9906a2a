"""Memoize vLLM's `replay_boundaries`, which its scheduler recomputes for every running request every step.

Why this exists: with prefix caching on, vLLM 0.32's scheduler caches each scheduled request's full KV
blocks after allocating its slots (`KVCacheCoordinator.cache_blocks`), and that first computes where a
later request replaying the prompt could resume (`kv_cache_coordinator.replay_boundaries`). Once an
EAGLE-family drafter (MTP) is configured, that is a small sorted-set computation instead of a constant,
run for every request on every step although it depends only on the prompt's length and the block size.
At 64 decoding sequences it was most of what vLLM's `Scheduler.schedule` costs more with a speculative
config than without: about 0.07-0.09 ms a step, some 1% of a plain step of the tiny default, paid by an
adaptive engine on every step it drafts nothing and by a fixed-k engine on every step. The function is
pure (three ints in, a tuple out), so it is wrapped in an LRU cache in the engine core's process.

Two ways in, both into that process: the adaptive scheduler installs it when it is built, and
`vllm_plugin` (a vLLM general plugin, the `vllm.general_plugins` entry point in pyproject.toml, which
vLLM runs when an EngineCore starts) installs it where the engine that started the process asks for it
(`EngineProcessSettings.kv_replay_cache`, engine_process.py), as every engine that drafts does, so
fixed-k engines, which run vLLM's own scheduler, get it too. The plugin also adds the engine-core
utility `STATS_UTILITY` that reports the cache's counts.

`install()` checks the function exists with the parameters it expects and that `cache_blocks` looks it
up as a module global (so replacing that global reaches the caller), and raises `KvReplayCacheError`
naming what moved otherwise.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

TARGET_MODULE = "vllm.v1.core.kv_cache_coordinator"
TARGET_ATTR = "replay_boundaries"
TARGET_PARAMS = ("num_prompt_tokens", "scheduler_block_size", "use_eagle")
CACHE_SIZE = 8192   # distinct (prompt length, block size, eagle) keys: at most max_model_len per block size
STATS_UTILITY = "skyrl_kv_replay_cache_stats"


class KvReplayCacheError(RuntimeError):
    """The vLLM function this module memoizes, or the way its caller reaches it, has changed."""


def install() -> Any:
    """Replace vLLM's `replay_boundaries` with a memoized wrapper of it (once per process); returns the
    wrapper, whose `cache_info()` says how often it answered from the cache."""
    module = importlib.import_module(TARGET_MODULE)
    fn = getattr(module, TARGET_ATTR, None)
    if fn is None:
        raise KvReplayCacheError(f"vLLM changed: {TARGET_MODULE}.{TARGET_ATTR} no longer exists")
    if getattr(fn, "_skyrl_memo", False):
        return fn
    params = tuple(inspect.signature(fn).parameters)
    if params != TARGET_PARAMS:
        raise KvReplayCacheError(f"vLLM changed: {TARGET_MODULE}.{TARGET_ATTR} takes {params}, expected "
                                 f"{TARGET_PARAMS}")
    coordinator = getattr(module, "KVCacheCoordinator", None)
    try:
        caller = inspect.getsource(coordinator.cache_blocks)   # type: ignore[union-attr]
    except (AttributeError, OSError, TypeError) as e:
        raise KvReplayCacheError(f"cannot read {TARGET_MODULE}.KVCacheCoordinator.cache_blocks to check it: "
                                 f"{e}") from e
    if f"{TARGET_ATTR}(" not in caller:
        raise KvReplayCacheError(f"vLLM changed: KVCacheCoordinator.cache_blocks no longer calls "
                                 f"{TARGET_ATTR}, so memoizing it would not reach the scheduler")
    memo = functools.lru_cache(maxsize=CACHE_SIZE)(fn)
    memo._skyrl_memo = True  # type: ignore[attr-defined]
    setattr(module, TARGET_ATTR, memo)
    return memo


def stats() -> dict[str, int] | None:
    """The cache's hits and misses in this process, or None when `install()` has not run here."""
    fn = getattr(importlib.import_module(TARGET_MODULE), TARGET_ATTR, None)
    if not getattr(fn, "_skyrl_memo", False):
        return None
    info = fn.cache_info()  # type: ignore[union-attr]
    return {"hits": info.hits, "misses": info.misses}


def vllm_plugin() -> None:
    """vLLM general plugin (run in each vLLM process that loads plugins, the engine core included): where
    the engine's settings ask for it (engine_process.py), install the memo and the engine-core utility that
    reports it. Elsewhere, nothing."""
    from skyrl_mtp import engine_process

    if not engine_process.current().kv_replay_cache:
        return
    install()
    from vllm.v1.engine.core import EngineCore

    existing = getattr(EngineCore, STATS_UTILITY, None)
    if existing is None:
        setattr(EngineCore, STATS_UTILITY, _stats_utility)
    elif existing is not _stats_utility:
        raise KvReplayCacheError(f"vLLM's EngineCore already has a `{STATS_UTILITY}` that is not skyrl_mtp's")


def _stats_utility(self: object) -> dict[str, int] | None:
    """Engine-core utility (`call_utility_async(STATS_UTILITY)`): stats() in the engine core's process."""
    return stats()
