"""Engines shared by the rollout integration tests, never more than three vLLM engines alive at once.

Each vLLM engine costs ~2.2 GiB and 15-50 s to start on the 2-core test machines, so the tests share
a session `EnginePool`: it starts EngineClients by name on demand (several at once, concurrently) and
shuts down the least recently used ones when a new one would exceed the budget. Tests switch
checkpoints by syncing weights, not by starting engines; a module that starts engines of its own takes
`no_pooled_engines` first. The named configurations:

- "nospec": no speculative decoding, fresh on the ORACLE checkpoint (the greedy reference).
- "k1": MTP k=1, fresh on the ORACLE checkpoint.
- "k3": MTP k=3, fresh on the RANDOM-head checkpoint (the default tiny one).
- "k2": MTP k=2, TWO engines behind one client, fresh on the ORACLE checkpoint (passes engine kwargs: each
  runs its worker in a process of its own, vLLM's "mp" executor, where the CPU default is "uni").
- "k1_vllm_coupling": MTP k=1 on the ORACLE checkpoint with vLLM's own rejection-sampling coupling
  (draft_invariant_sampling=False).
- "auto": adaptive speculation (k chosen per engine step, maximum 3), fresh on the ORACLE checkpoint.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from skyrl_mtp.models.tiny import TinyModelSpec, cached_tiny_checkpoint

MAX_ALIVE_ENGINES = 3
SMALL = {"max_model_len": 256, "max_num_seqs": 16, "kv_cache_memory_bytes": 32 * 2**20}


class EnginePool:
    """Named EngineClients started on demand; at most `max_engines` vLLM engines alive (LRU eviction)."""

    def __init__(self, configs: dict[str, Callable[[], object]], max_engines: int = MAX_ALIVE_ENGINES):
        self._configs = configs
        self._max = max_engines
        self._alive: dict[str, object] = {}   # insertion order = least recently used first

    def get(self, *names: str):
        """The clients for `names` (one client if one name), starting the missing ones concurrently."""
        from skyrl_mtp.rollout.client import EngineClient

        unknown = [n for n in names if n not in self._configs]
        if unknown:
            raise KeyError(f"unknown engine names {unknown}; known: {sorted(self._configs)}")
        cfgs = {n: self._configs[n]() for n in names if n not in self._alive}
        need = sum(c.num_engines for c in cfgs.values())
        for n in list(self._alive):
            if self._count() + need <= self._max:
                break
            if n not in names:
                self._alive.pop(n).shutdown()
        if self._count() + need > self._max:
            raise RuntimeError(f"engines {names} need more than {self._max} alive vLLM engines")
        if cfgs:
            with ThreadPoolExecutor(max_workers=len(cfgs)) as pool:
                futures = {n: pool.submit(EngineClient.create, c) for n, c in cfgs.items()}
                errors = []
                for n, fut in futures.items():
                    try:
                        self._alive[n] = fut.result()
                    except Exception as e:  # noqa: BLE001 - keep the started ones (shut down at the end), raise the first
                        if not _lost_a_port_race(e):
                            errors.append(e)
                            continue
                        # vLLM picks a free port, closes it and binds it again later; with engines and Ray
                        # starting side by side another process can take it in between: one more try, alone
                        warnings.warn(f"engine {n!r} lost a port race at start-up ({e!r:.200}); starting it again",
                                      stacklevel=2)
                        try:
                            self._alive[n] = EngineClient.create(self._configs[n]())
                        except Exception as again:  # noqa: BLE001
                            errors.append(again)
                if errors:
                    raise errors[0]
        for n in names:  # mark as most recently used
            self._alive[n] = self._alive.pop(n)
        clients = tuple(self._alive[n] for n in names)
        return clients[0] if len(clients) == 1 else clients

    def _count(self) -> int:
        return sum(c.num_engines for c in self._alive.values())

    def shutdown(self) -> None:
        while self._alive:
            self._alive.pop(next(iter(self._alive))).shutdown()


# an engine core that dies in its own process leaves only this in the exception (the cause is in its log)
PORT_RACE = ("EADDRINUSE", "Address already in use", "Engine core initialization failed")


def _lost_a_port_race(error: BaseException) -> bool:
    """The start may have failed because a port vLLM had found free was taken: the message or one of its
    causes says so, or says only that the engine core process died while starting."""
    seen: BaseException | None = error
    while seen is not None:
        if any(p in str(seen) for p in PORT_RACE):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _spec(**kw) -> TinyModelSpec:
    return TinyModelSpec(seed=0, **kw)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_ckpts")


@pytest.fixture(scope="session")
def random_ckpt(tiny_cache) -> Path:
    """The default tiny checkpoint: random trunk, random (untrained) MTP head."""
    return cached_tiny_checkpoint(tiny_cache, _spec())


@pytest.fixture(scope="session")
def oracle_ckpt(tiny_cache) -> Path:
    """Bigram target with an MTP head that always drafts the target's greedy token."""
    return cached_tiny_checkpoint(tiny_cache, _spec(head="oracle"))


@pytest.fixture(scope="session")
def no_mtp_ckpt(tiny_cache) -> Path:
    return cached_tiny_checkpoint(tiny_cache, _spec(mtp_layers=0))


@pytest.fixture(scope="session")
def engine_pool(ray_local, random_ckpt, oracle_ckpt, tmp_path_factory):
    from skyrl_mtp.rollout.config import EngineConfig

    trace_dir = str(tmp_path_factory.mktemp("policy_trace"))   # "auto" records its policy's calls there

    configs = {
        "nospec": lambda: EngineConfig(model_path=str(oracle_ckpt), num_speculative_tokens=0, **SMALL),
        "k1": lambda: EngineConfig(model_path=str(oracle_ckpt), num_speculative_tokens=1, **SMALL),
        "k3": lambda: EngineConfig(model_path=str(random_ckpt), num_speculative_tokens=3, **SMALL),
        "k1_vllm_coupling": lambda: EngineConfig(model_path=str(oracle_ckpt), num_speculative_tokens=1,
                                                 draft_invariant_sampling=False, **SMALL),
        "auto": lambda: EngineConfig(model_path=str(oracle_ckpt), num_speculative_tokens=3,
                                     adaptive_speculation=True, explore_budget=0.03, policy_trace_dir=trace_dir,
                                     **SMALL),
        "k2": lambda: EngineConfig(model_path=str(oracle_ckpt), num_speculative_tokens=2, num_engines=2,
                                   engine_kwargs={"max_num_batched_tokens": 1536, "distributed_executor_backend": "mp"},
                                   **SMALL),
    }
    pool = EnginePool(configs)
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def no_pooled_engines(engine_pool):
    """For a module that starts engines of its own: the pool's engines are shut down first (the local Ray
    cluster's CPUs and the machine's memory hold only a few engines at once; later tests restart theirs)."""
    engine_pool.shutdown()
