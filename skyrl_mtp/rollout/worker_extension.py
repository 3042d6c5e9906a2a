"""Methods vLLM mixes into its worker (`worker_extension_cls`) so the engine can take new weights in place.

They run inside the worker process, where the model lives, and are called by name through
`collective_rpc` (no insecure serialization). They rely on vLLM internals that are not a public
API (the model runner's `reload_weights` and `get_draft_model`, and the in-place reload function);
`skyrl_check_reload_api` verifies those are still there with the expected signatures and fails
loudly otherwise, and the engine calls it at start.

Both the main model and the MTP drafter are reloaded on every update: reloading only the main
model leaves the drafter stale.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator

import torch

from skyrl_mtp.rollout import draft_invariant_sampling
from skyrl_mtp.rollout.cpu_sampling_fix import apply_if_needed
from skyrl_mtp.rollout.weight_sync import deserialize_weights, drafter_subset, torch_dtype

# The single call site of the CPU sampling fix (issue 8). This module is imported in every vLLM worker
# process (worker_extension_cls), where the sampler runs; SKYRL_MTP_CPU_SAMPLING_FIX is set from
# EngineConfig.cpu_sampling_fix by engine.engine_environment() in the engine actor and inherited.
CPU_SAMPLING_FIX_STATUS = "not_cpu"
if not torch.cuda.is_available():  # imported in vLLM's worker process: fix its CPU spec-decode sampling there
    CPU_SAMPLING_FIX_STATUS = apply_if_needed(os.environ.get("SKYRL_MTP_CPU_SAMPLING_FIX", "1") != "0")
# Same place, same reason: the rejection sampler runs here. Set from EngineConfig.draft_invariant_sampling.
DRAFT_INVARIANT_SAMPLING_STATUS = "not_cpu"
if not torch.cuda.is_available():
    DRAFT_INVARIANT_SAMPLING_STATUS = draft_invariant_sampling.apply_if_enabled(
        os.environ.get(draft_invariant_sampling.ENV_VAR, "1") != "0")

_MAIN_RELOAD_PARAMS = ("weights_iterator", "weights_path", "is_checkpoint_format")
_INPLACE_RELOAD_PARAMS = ("vllm_config", "model", "weights_iterator", "weights_path", "is_checkpoint_format")


def _require_params(fn, wanted: tuple[str, ...], what: str) -> None:
    params = tuple(inspect.signature(fn).parameters)
    missing = [p for p in wanted if p not in params]
    if missing:
        raise RuntimeError(f"vLLM changed {what}: parameters {missing} are gone (has {params}); "
                           "skyrl_mtp's weight sync must be updated for this vLLM version")


def _inplace_reload():
    try:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights
    except ImportError as e:
        raise RuntimeError("vLLM no longer has vllm.model_executor.model_loader.reload.inplace.reload_weights; "
                           "skyrl_mtp's weight sync must be updated for this vLLM version") from e
    return reload_weights


class WeightSyncExtension:
    """Mixed into vLLM's worker: `self.model_runner`, `self.vllm_config`, `self.device`, `self.rank` exist."""

    def skyrl_check_reload_api(self) -> dict:
        runner = getattr(self, "model_runner", None)
        if runner is None:
            raise RuntimeError("vLLM worker has no `model_runner`; skyrl_mtp's weight sync cannot reach the model")
        for attr in ("reload_weights", "get_draft_model"):
            if not callable(getattr(runner, attr, None)):
                raise RuntimeError(f"vLLM model runner {type(runner).__name__} has no `{attr}`; skyrl_mtp's weight "
                                   "sync must be updated for this vLLM version")
        _require_params(runner.reload_weights, _MAIN_RELOAD_PARAMS, f"{type(runner).__name__}.reload_weights")
        _require_params(_inplace_reload(), _INPLACE_RELOAD_PARAMS, "reload.inplace.reload_weights")
        return {"runner": type(runner).__name__, "has_drafter": runner.get_draft_model() is not None,
                "cpu_sampling_fix": CPU_SAMPLING_FIX_STATUS,
                "draft_invariant_sampling": DRAFT_INVARIANT_SAMPLING_STATUS}

    def _skyrl_reload(self, main_weights: Iterator[tuple[str, torch.Tensor]],
                      drafter_weights: list[tuple[str, torch.Tensor]]) -> None:
        """`drafter_weights` is read after the main pass, so a streaming source may fill it meanwhile."""
        from vllm.config import set_current_vllm_config

        runner = self.model_runner
        with set_current_vllm_config(self.vllm_config):
            runner.reload_weights(weights_iterator=main_weights, weights_path=None, is_checkpoint_format=True)
            for _ in main_weights:   # a streaming source (NCCL) must be drained even if the loader stopped early
                pass
            draft = runner.get_draft_model()
            if draft is not None:
                _inplace_reload()(self.vllm_config, draft, weights_iterator=iter(drafter_weights),
                                  weights_path=None, is_checkpoint_format=True)

    def skyrl_load_weights_bytes(self, blob: bytes) -> int:
        """Reload main model and drafter from a safetensors blob; returns the number of tensors."""
        weights = deserialize_weights(blob)
        items = list(weights.items())
        keep = set(drafter_subset([n for n, _ in items]))
        self._skyrl_reload(iter(items), [(n, t) for n, t in items if n in keep])
        return len(items)

    # ---- NCCL (GPU) ----------------------------------------------------------------------

    def skyrl_init_nccl_group(self, master_addr: str, master_port: int, rank_offset: int, world_size: int) -> int:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        rank = rank_offset + int(getattr(self, "rank", 0))
        group = StatelessProcessGroup.create(host=master_addr, port=master_port, rank=rank, world_size=world_size)
        self._skyrl_nccl = PyNcclCommunicator(group, device=self.device)
        return rank

    def skyrl_receive_weights_nccl(self, plan: list[tuple[str, list[int], str]]) -> int:
        """Receive tensors broadcast by rank 0 in `plan` order and reload main model and drafter.

        The main model consumes each tensor as it arrives; only the drafter's subset is kept for its pass.
        """
        comm = getattr(self, "_skyrl_nccl", None)
        if comm is None:
            raise RuntimeError("skyrl_init_nccl_group was not called on this worker")
        keep = set(drafter_subset([name for name, _, _ in plan]))
        drafter: list[tuple[str, torch.Tensor]] = []

        def received() -> Iterator[tuple[str, torch.Tensor]]:
            stream = torch.cuda.current_stream(self.device)
            for name, shape, dtype in plan:
                t = torch.empty(shape, dtype=torch_dtype(dtype), device=self.device)
                comm.broadcast(t, src=0, stream=stream)
                stream.synchronize()
                if name in keep:
                    drafter.append((name, t))
                yield name, t

        self._skyrl_reload(received(), drafter)
        return len(plan)

    def skyrl_close_nccl_group(self) -> None:
        self._skyrl_nccl = None
