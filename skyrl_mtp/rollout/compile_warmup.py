"""Compile, at engine start, the sampler ops vLLM compiles lazily, so the cost never lands in an RL step.

Why this exists: vLLM compiles a few small sampler ops with torch.compile even when the engine runs
eager (`enforce_eager` covers the model only). The first call in a worker process pays for inductor:
its CPU ISA probe (compiling and loading test kernels in subprocesses) and loading the graph, about
1 s on the 2-core machine. With `logprobs=1` (every RL rollout) `Sampler.gather_logprobs` calls
`batched_count_greater_than` and pays that cost at its first call. That call came a few
steps into a run, in the middle of a rollout, and stalled the other processes of the step with it.
In `benchmarks/step_time.py` it fell inside the measured steps of one set-up and before them in another.

`warm_up(device, vocab_size)` calls the op on a dummy batch the way vLLM's worker calls it: under inference
mode, on rows as wide as the vocabulary (both are guards of the compiled graph), with the batch dimension
marked unbacked, so the graph serves every batch size. It returns what it did, and `graphs_total`: the
process's count of compiled graphs, which stays there while nothing compiles. A vLLM that no longer has
the op is reported (`missing`), not raised: the engine still serves; only the stall comes back.
"""

from __future__ import annotations

import time
from typing import Any

OPS = ("vllm.v1.sample.ops.logprobs.batched_count_greater_than",)


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process (dynamo's own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def warm_up(device: Any, vocab_size: int) -> dict[str, Any]:
    import importlib

    import torch

    t0, graphs0 = time.perf_counter(), compiled_graphs()
    warmed, missing = [], []
    for path in OPS:
        module, name = path.rsplit(".", 1)
        try:
            op = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            missing.append(path)
            continue
        with torch.inference_mode():   # as vLLM's worker runs the sampler: grad mode is a guard
            logprobs = torch.log_softmax(torch.randn(2, vocab_size, device=device, dtype=torch.float32), dim=-1)
            values = logprobs[:, :1].contiguous()
            torch._dynamo.decorators.mark_unbacked(logprobs, 0)
            torch._dynamo.decorators.mark_unbacked(values, 0)
            counts = op(logprobs, values)
        if counts.shape != (2,):
            raise RuntimeError(f"{path} returned shape {tuple(counts.shape)} for a batch of 2; vLLM changed it")
        warmed.append(path)
    total = compiled_graphs()
    return {"warmed": warmed, "missing": missing, "graphs": total - graphs0, "graphs_total": total,
            "seconds": time.perf_counter() - t0}
