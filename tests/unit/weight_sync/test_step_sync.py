"""StepSync's ordering (pure logic, fake engines): colocated engines sleep after the rollouts and wake
weights -> sync -> KV cache -> prefix-cache reset; not colocated: sync -> reset. The real-engine version
of this test is tests/integration/rollout/test_engines.py::test_colocated_step_sleeps_and_wakes_in_vllm_order."""

from __future__ import annotations

from skyrl_mtp.weight_sync.step_sync import StepSync


class FakeEngines:
    def __init__(self, calls, sync_parts=("main", "draft")):
        self.calls, self.sync_parts = calls, list(sync_parts)

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


class FakeLink:
    def __init__(self, calls):
        self.calls = calls

    def push(self, parts=None):
        self.calls.append(("push",) if parts is None else ("push", tuple(parts)))
        return {"sync/main_seconds": 0.5, "sync/main_bytes": 100.0, "sync/draft_seconds": 0.25, "sync/draft_bytes": 20.0}


class FakePolicy:
    def __init__(self, calls):
        self.calls = calls

    def release_device_memory(self):
        self.calls.append(("policy_release",))

    def reclaim_device_memory(self):
        self.calls.append(("policy_reclaim",))


def _step(colocate: bool, sync_twice: bool = False, policy: bool = False):
    calls: list = []
    step = StepSync(FakeLink(calls), FakeEngines(calls), colocate=colocate,
                    policy=FakePolicy(calls) if policy else None)
    step.release_engines()
    step.release_engines()   # idempotent: already asleep
    stats = step.sync()
    if sync_twice:
        step.sync()          # e.g. the resume sync: engines awake, no wake calls
    return calls, stats


def test_colocated_order():
    calls, stats = _step(True)
    assert calls == [("sleep", 2), ("wake_up", ("weights",)), ("push",), ("wake_up", ("kv_cache",)),
                     ("reset_prefix_cache",)]
    assert stats["sync/bytes"] == 120.0 and stats["sync/main_bytes"] == 100.0 and stats["sync/seconds"] >= 0


def test_colocated_policy_takes_its_memory_back_after_the_sleep_and_hands_it_over_before_the_wake():
    calls, _ = _step(True, policy=True)
    assert calls == [("sleep", 2), ("policy_reclaim",),                 # then the policy trains
                     ("policy_release",), ("wake_up", ("weights",)), ("push",), ("wake_up", ("kv_cache",)),
                     ("reset_prefix_cache",)]
    calls, _ = _step(False, policy=True)
    assert calls == [("push",), ("reset_prefix_cache",)]                # separate pools: nothing to hand over


def test_separate_pools_never_sleep():
    calls, _ = _step(False)
    assert calls == [("push",), ("reset_prefix_cache",)]


def test_awake_engines_are_not_woken():
    calls, _ = _step(True, sync_twice=True)
    assert calls[-2:] == [("push",), ("reset_prefix_cache",)]


def test_unchanged_head_is_not_pushed_to_awake_engines():
    calls: list = []
    step = StepSync(FakeLink(calls), FakeEngines(calls), colocate=False)
    step.sync(head_changed=False)
    step.sync(head_changed=True)
    assert calls == [("push", ("main",)), ("reset_prefix_cache",), ("push",), ("reset_prefix_cache",)]


def test_colocated_engines_that_slept_get_the_whole_sync_even_for_an_unchanged_head():
    calls: list = []
    step = StepSync(FakeLink(calls), FakeEngines(calls), colocate=True)
    step.release_engines()
    step.sync(head_changed=False)        # level-2 sleep dropped the drafter's weights too
    step.sync(head_changed=False)        # awake now (e.g. a resume sync): the head they hold is current
    assert [c for c in calls if c[0] == "push"] == [("push",), ("push", ("main",))]


def test_engines_without_a_drafter_always_get_the_plain_push():
    calls: list = []
    StepSync(FakeLink(calls), FakeEngines(calls, sync_parts=["main"]), colocate=False).sync(head_changed=False)
    assert calls == [("push",), ("reset_prefix_cache",)]


def test_colocated_engine_sees_its_policy_ranks_gpus():
    import pytest

    from skyrl_mtp.rollout.engine import colocated_gpu_options

    env = colocated_gpu_options(["2", "3"])["runtime_env"]["env_vars"]
    assert env == {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "2,3"}
    with pytest.raises(ValueError, match="GPU ids of its policy ranks"):
        colocated_gpu_options(["0", ""])
