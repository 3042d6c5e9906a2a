"""Checks of `generator.engine_kwargs` at validation: the refusals the engines would make once started.

The extra vLLM engine arguments may not set what the project manages (the EngineConfig fields), may not carry
the project's own additional_config entries, must be vLLM engine arguments, and may not contradict what the
model's family needs from vLLM (e.g. a kernel switched off on CPU).
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from skyrl_mtp.config.checker import Checker

KEY = "generator.engine_kwargs"


def known_engine_args(verbose: bool) -> set[str] | None:
    """vLLM's engine argument names, or None where vLLM is not installed (the engines check them at start);
    `verbose` false: the known harmless notices vLLM logs while it is imported are hidden (logger.verbose)."""
    from skyrl_mtp.tracking.quiet_logs import hide_import_warnings

    if not verbose:
        hide_import_warnings()
    try:
        import dataclasses

        from vllm.engine.arg_utils import AsyncEngineArgs
    except ImportError:
        return None
    return {f.name for f in dataclasses.fields(AsyncEngineArgs)}


def engine_kwargs_checks(c: Checker, family: Any | None) -> None:
    """`family`: the model family the engines serve (None when unknown: its rule is then not checked)."""
    from skyrl_mtp.rollout.config import MANAGED_ENGINE_KWARGS, MERGED_ENGINE_KWARGS

    settable = sorted(set(MANAGED_ENGINE_KWARGS) - set(MERGED_ENGINE_KWARGS))
    c.rule(KEY, f"vLLM engine arguments other than those the project sets ({settable}), agreeing with what the "
                "model's family needs from vLLM")
    raw = c.get(KEY)
    kwargs = OmegaConf.to_container(raw, resolve=True) if raw is not None else {}
    if not kwargs:
        return
    clashes = sorted(set(kwargs) & set(settable))
    if clashes:
        c.add(KEY, kwargs, f"keys {clashes} are set by the project from their own keys (e.g. "
                           "generator.max_model_len, generator.dtype, trainer.mtp.*); set those instead")
        return
    extra = kwargs.get("additional_config", {})
    if not isinstance(extra, dict) or any(str(k).startswith("skyrl_mtp") for k in extra):
        c.add(KEY, kwargs, "additional_config must be a mapping without skyrl_mtp's own entries (auto k's settings "
                           "come from trainer.mtp.*)")
        return
    known = known_engine_args(bool(c.get("logger.verbose")))
    unknown = sorted(set(kwargs) - known) if known is not None else []
    if unknown:
        c.add(KEY, kwargs, f"keys {unknown} are not vLLM engine arguments (vllm.engine.arg_utils.AsyncEngineArgs)")
        return
    if family is None:
        return
    on_cpu = c.get("trainer.placement.gpus_per_engine") == 0
    required = family.required_engine_kwargs(on_cpu)
    for name, value in required.items():
        if name in kwargs and kwargs[name] != value:
            c.add(KEY, kwargs, f"{name} must be {value!r} (or left out) with a {family.name} model"
                               f"{' on CPU engines' if name in family.cpu_engine_overrides and on_cpu else ''}: "
                               "vLLM needs it for this model family")
            return
