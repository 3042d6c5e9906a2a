"""The worker half of closing a weight sync that failed part way (the engine half is rollout/update_session.py).

Read in vLLM 0.32 (v1/worker/gpu_worker.py): an update that raises inside the worker clears
`_weight_update_active` without finalizing the layerwise reload, and an update that never reached the worker
leaves the session open. `close_weight_update` closes either: it finishes vLLM's open session, or finalizes the
dangling reload, which puts back the previous weights of every layer that received none. It runs on every
worker of the engine, so it also covers a pipeline stage without the drafter (every stage but the last): its
draft session loaded into a module that keeps nothing (vllm_patches/pipeline_parallel.py), so there is no reload
to finalize there, only vLLM's session to finish. Imported by the worker extension; no vLLM import at module
level.
"""

from __future__ import annotations

from typing import Any

PARTS = ("main", "draft")


def close_weight_update(worker: Any, part: str) -> dict[str, Any]:
    """Close `worker`'s session of `part` ("main" or "draft"); returns how it was closed and how many layers had
    received new weights (0: the model holds its previous weights)."""
    if part not in PARTS:
        raise ValueError(f"part={part!r} is invalid; allowed: {', '.join(repr(p) for p in PARTS)}")
    if not hasattr(worker, "_weight_update_active"):
        raise RuntimeError(f"vLLM worker {type(worker).__name__} has no `_weight_update_active`; skyrl_mtp's abort "
                           "of a failed weight sync must be updated for this vLLM version")
    model = worker.get_draft_model() if part == "draft" else worker.get_model()
    written, waiting = reload_progress(model) if model is not None else (0, 0)
    if worker._weight_update_active:
        worker.finish_weight_update()
        how = "finished"
    elif waiting:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model_config = worker.speculative_config.draft_model_config if part == "draft" else worker.model_config
        with set_current_vllm_config(worker.vllm_config):
            finalize_layerwise_reload(model, model_config)
        how = "finalized"
    else:
        how = "nothing open"
    return {"closed": how, "layers_written": written}


def reload_progress(model: Any) -> tuple[int, int]:
    """(layers that received new weights, layers still waiting) of a model in vLLM's layerwise reload; (0, 0)
    when none is in progress. `initialize_layerwise_reload` puts every module in it; a module whose weights all
    arrived is processed and leaves it (its info reset), a module part way holds a nonzero `load_numel`."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    infos = [(m, LAYERWISE_INFO.get(m)) for m in model.modules()]
    for _m, info in infos:
        if info is not None and not (hasattr(info, "can_load") and hasattr(info, "load_numel")):
            raise RuntimeError("vLLM's LayerReloadingInfo has no can_load/load_numel any more; skyrl_mtp's "
                               "reload_progress must be updated for this vLLM version")
    waiting = [(m, i) for m, i in infos if i is not None and i.can_load()]
    if not waiting:
        return 0, 0
    done = sum(1 for m, i in infos if i is not None and not i.can_load() and any(True for _ in m.parameters(recurse=False)))
    part_way = sum(1 for _m, i in waiting if i.load_numel > 0)
    return done + part_way, len(waiting)
