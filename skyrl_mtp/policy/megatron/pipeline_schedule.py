"""The policy's micro-batches through megatron-core's pipeline schedule (1F1B, non-interleaved), CPU or GPU.

With ``megatron.pp > 1`` each rank holds one stage; megatron-core's
``forward_backward_pipelining_without_interleaving`` runs the micro-batches through the stages, passing
activations forward and their gradients back with its p2p communication. The policy gives it, per
micro-batch, the model call and a loss function that runs on the last stage only (the policy loss and the
decoupled draft loss there, see MegatronPolicy). Settings of the model config this needs, made by
``configure``:

- ``calculate_per_token_loss``: the schedule otherwise divides each micro-batch's loss by the number of
  micro-batches; the policy's losses are already normalised over the whole (data-parallel) batch.
- ``batch_p2p_comm`` off: each send / receive is an isend / irecv pair (gloo has no batched p2p; the batched
  path also synchronises CUDA).
- ``deallocate_pipeline_outputs`` off, no ``finalize_model_grads_func``: the policy reduces and clips
  gradients itself (both optimizer paths), so the embedding group's all-reduce is not used either.

On CPU the schedule's few CUDA-only calls (a token counter created on ``device="cuda"``; p2p buffers on
``torch.cuda.current_device()``) run under the CPU shim (``cpu_shim.apply_cpu_shim`` and its
``cuda_calls_on_cpu`` scope). The micro-batch size is fixed per schedule run (the p2p buffers have
one shape): a remainder runs as a second, smaller run; gradients accumulate across runs as across micro-batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

# config field -> value the schedule runs with here
SCHEDULE_CONFIG = {"calculate_per_token_loss": True, "batch_p2p_comm": False, "batch_p2p_sync": False,
                   "deallocate_pipeline_outputs": False, "variable_seq_lengths": False,
                   "overlap_p2p_comm": False, "finalize_model_grads_func": None}


class PipelineScheduleError(RuntimeError):
    """megatron-core's schedule API is not what this module drives."""


def configure(model: torch.nn.Module) -> None:
    cfg = model.config
    missing = [k for k in SCHEDULE_CONFIG if not hasattr(cfg, k)]
    if missing:
        raise PipelineScheduleError(f"megatron-core's TransformerConfig has no {missing}; the pipeline schedule "
                                    "settings in policy/megatron/pipeline_schedule.py must be updated")
    for k, v in SCHEDULE_CONFIG.items():
        setattr(cfg, k, v)


def _schedule() -> Callable:
    from megatron.core.pipeline_parallel import schedules

    fn = getattr(schedules, "forward_backward_pipelining_without_interleaving", None)
    if fn is None:
        raise PipelineScheduleError("megatron.core.pipeline_parallel.schedules."
                                    "forward_backward_pipelining_without_interleaving is gone")
    import inspect

    params = set(inspect.signature(fn).parameters)
    need = {"forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length", "micro_batch_size",
            "forward_only"}
    if not need <= params:
        raise PipelineScheduleError(f"forward_backward_pipelining_without_interleaving lacks {sorted(need - params)}")
    return fn


def _runs(micro_batches: list[dict]) -> Iterator[list[dict]]:
    """Consecutive runs of micro-batches of one size."""
    run: list[dict] = []
    for mb in micro_batches:
        if run and mb["input_ids"].shape[0] != run[0]["input_ids"].shape[0]:
            yield run
            run = []
        run.append(mb)
    if run:
        yield run


def run_pipeline(model: torch.nn.Module, micro_batches: list[dict], last_stage_loss: Callable[[dict, Any], Any],
                 *, forward_only: bool, on_cpu: bool) -> None:
    """Run every micro-batch through the stages; on the last stage ``last_stage_loss(mb, logits)`` returns the
    scalar to back-propagate (forward_only: anything; nothing is back-propagated)."""
    schedule = _schedule()

    def forward_step(data_iterator, model_):
        mb = next(data_iterator)
        out = model_(mb["input_ids"], mb["position_ids"], mb["megatron_mask"])

        def loss_func(output_tensor):
            loss = last_stage_loss(mb, output_tensor)
            if loss is None:
                loss = output_tensor.sum() * 0.0
            return loss, torch.ones((), dtype=torch.int), {}

        return out, loss_func

    scope = contextlib.nullcontext()
    if on_cpu:
        from skyrl_mtp.policy.megatron.cpu_shim import cuda_calls_on_cpu

        scope = cuda_calls_on_cpu()
    with scope:
        for run in _runs(micro_batches):
            b, s = run[0]["input_ids"].shape
            schedule(forward_step_func=forward_step, data_iterator=iter(run), model=model, num_microbatches=len(run),
                     seq_length=s, micro_batch_size=b, forward_only=forward_only)
