"""One RL step's weight sync and, for colocated engines, their sleep and wake, in vLLM's order.

Colocated (`trainer.placement.colocate=true`): after the rollouts the engines sleep (weights and KV cache
released) and the policy takes back what it handed over; it trains; then it hands its GPU memory over (its
allocator's cache emptied, grads and optimizer state to host memory where the memory plan says so), the engines
wake their weights, receive the sync, wake their KV cache (vLLM's documented order for RL), and their prefix
caches are reset. Not colocated: sync, then reset.
vLLM's CPU worker makes sleep/wake no-ops; the calls are made all the same, so CPU runs the GPU sequence.

A step whose update left the MTP head as it was (adaptive speculation's idle cadence) pushes the main
model only: the engines already hold that head. Colocated engines are the exception: their sleep dropped
every weight, so they always get the whole sync.
"""

from __future__ import annotations

import time
from typing import Any

# vLLM's sleep level 2: weights and KV cache both released (RL colocation; the sync refills the weights)
COLOCATED_SLEEP_LEVEL = 2


class StepSync:
    """`link.push() -> stats` pushes one sync (PolicyEngineLink); `engines` is the EngineClient; `policy` (the
    PolicyGroup, colocated runs) hands its GPU memory over before the engines wake and takes it back after."""

    def __init__(self, link: Any, engines: Any, colocate: bool, policy: Any = None):
        self.link, self.engines, self.colocate, self.policy = link, engines, bool(colocate), policy
        self.asleep = False

    def release_engines(self) -> None:
        """After the rollouts of a step: colocated engines give their memory to the policy."""
        if self.colocate and not self.asleep:
            self.engines.sleep(COLOCATED_SLEEP_LEVEL)
            self.asleep = True
            if self.policy is not None:
                self.policy.reclaim_device_memory()

    def sync(self, head_changed: bool = True) -> dict[str, float]:
        """Push the policy's weights (main model and drafter) to every engine; returns seconds and bytes per part.
        `head_changed=False`: the head is what the engines last received, so awake engines get the main part only."""
        t0 = time.perf_counter()
        main_only = not head_changed and not self.asleep and "draft" in self.engines.sync_parts
        if self.asleep:
            if self.policy is not None:
                self.policy.release_device_memory()
            self.engines.wake_up(["weights"])
        stats = dict(self.link.push(["main"]) if main_only else self.link.push())
        if self.asleep:
            self.engines.wake_up(["kv_cache"])
            self.asleep = False
        self.engines.reset_prefix_cache()
        stats["sync/seconds"] = time.perf_counter() - t0
        stats["sync/bytes"] = sum(v for k, v in stats.items() if k.endswith("_bytes"))
        return stats
