"""Unit tests of the memo of vLLM's `replay_boundaries`: same answers, reaches the caller, fails loudly."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import vllm.v1.core.kv_cache_coordinator as kcc  # noqa: E402

from skyrl_mtp import engine_process
from skyrl_mtp.vllm_patches import kv_replay_cache  # noqa: E402


@pytest.fixture
def original(monkeypatch):
    """vLLM's function as imported, restored after the test (install() replaces the module global)."""
    fn = getattr(kcc.replay_boundaries, "__wrapped__", kcc.replay_boundaries)
    monkeypatch.setattr(kcc, "replay_boundaries", fn)
    return fn


def test_the_memo_answers_what_vllm_computes_and_counts_its_hits(original):
    memo = kv_replay_cache.install()
    assert kcc.replay_boundaries is memo and memo is not original
    assert kv_replay_cache.install() is memo                       # once per process
    grid = [(n, block, eagle) for n in range(1, 70) for block in (1, 16, 32) for eagle in (False, True)]
    for args in grid:
        assert memo(*args) == original(*args), args
    for args in grid:
        assert memo(*args) == original(*args), args
    assert kv_replay_cache.stats() == {"hits": len(grid), "misses": len(grid)}


def test_an_eagle_prompt_has_two_reachable_boundaries_and_a_plain_one_has_one(original):
    # what makes the drafter's case dearer: a set of block-aligned positions instead of one constant
    assert original(40, 16, False) == (39,)
    assert original(40, 16, True) == (16,)
    assert original(48, 16, True) == (16, 32)


def test_the_scheduler_path_reaches_the_memo(original):
    """KVCacheCoordinator.cache_blocks looks the function up as a module global, so the memo is what it
    calls: a coordinator method run after install() adds to the memo's counts."""
    memo = kv_replay_cache.install()
    before = memo.cache_info().hits + memo.cache_info().misses

    class Req:
        num_prompt_tokens = 33

    class Coordinator:
        scheduler_block_size = 16
        eagle_group_ids = (0,)
        single_type_managers = ()
        retention_interval = 0

    kcc.KVCacheCoordinator.cache_blocks(Coordinator(), Req(), 40)
    assert memo.cache_info().hits + memo.cache_info().misses == before + 1


def test_without_install_there_are_no_stats(original):
    assert kv_replay_cache.stats() is None


def test_a_changed_signature_is_named(original, monkeypatch):
    monkeypatch.setattr(kcc, "replay_boundaries", lambda num_prompt_tokens, block_size, use_eagle: ())
    with pytest.raises(kv_replay_cache.KvReplayCacheError, match="block_size"):
        kv_replay_cache.install()


def test_a_missing_function_is_named(original, monkeypatch):
    monkeypatch.delattr(kcc, "replay_boundaries")
    with pytest.raises(kv_replay_cache.KvReplayCacheError, match="no longer exists"):
        kv_replay_cache.install()


def test_a_caller_that_no_longer_calls_it_is_named(original, monkeypatch):
    def cache_blocks(self, request, num_computed_tokens):
        return None

    monkeypatch.setattr(kcc.KVCacheCoordinator, "cache_blocks", cache_blocks)
    with pytest.raises(kv_replay_cache.KvReplayCacheError, match="no longer calls"):
        kv_replay_cache.install()


@pytest.fixture
def no_utility(monkeypatch):
    """EngineCore without the plugin's stats utility, and as it was after the test."""
    from vllm.v1.engine.core import EngineCore

    monkeypatch.delattr(EngineCore, kv_replay_cache.STATS_UTILITY, raising=False)
    yield EngineCore
    if hasattr(EngineCore, kv_replay_cache.STATS_UTILITY):
        delattr(EngineCore, kv_replay_cache.STATS_UTILITY)


def _asks_for_the_memo() -> tuple[str, str]:
    (name, value), = engine_process.EngineProcessSettings(kv_replay_cache=True).to_env().items()
    return name, value


def test_the_vllm_plugin_does_nothing_unless_its_engine_asked(original, no_utility, monkeypatch):
    monkeypatch.delenv(engine_process.ENV_VAR, raising=False)
    kv_replay_cache.vllm_plugin()
    assert kcc.replay_boundaries is original and kv_replay_cache.stats() is None
    assert not hasattr(no_utility, kv_replay_cache.STATS_UTILITY)


def test_the_vllm_plugin_installs_the_memo_and_its_engine_core_utility(original, no_utility, monkeypatch):
    monkeypatch.setenv(*_asks_for_the_memo())
    kv_replay_cache.vllm_plugin()
    kv_replay_cache.vllm_plugin()   # vLLM may load plugins more than once in a process
    assert kcc.replay_boundaries is not original
    kcc.replay_boundaries(40, 16, True)
    kcc.replay_boundaries(40, 16, True)
    utility = getattr(no_utility, kv_replay_cache.STATS_UTILITY)
    assert utility(object()) == {"hits": 1, "misses": 1}


def test_the_vllm_plugin_is_registered_as_a_general_plugin():
    from importlib.metadata import entry_points

    found = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert found.get("skyrl_mtp_kv_replay_cache") == "skyrl_mtp.vllm_patches.kv_replay_cache:vllm_plugin", found


def test_a_foreign_utility_of_the_same_name_is_refused(original, no_utility, monkeypatch):
    monkeypatch.setenv(*_asks_for_the_memo())
    setattr(no_utility, kv_replay_cache.STATS_UTILITY, lambda self: None)
    with pytest.raises(kv_replay_cache.KvReplayCacheError, match="already has"):
        kv_replay_cache.vllm_plugin()
