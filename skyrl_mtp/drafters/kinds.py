"""The external drafter kinds vLLM serves beside a target, by speculative method: how to check an export against its
target and which tensors a weight sync's "draft" part carries. One registration line per kind."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ExternalDrafterKind:
    method: str                                            # vLLM's speculative_config["method"]
    check_export: Callable[[str | Path, dict, str], None]  # (export dir, target config.json, key) -> ValueError
    is_tensor: Callable[[str], bool]                       # a tensor of the export (never a target's name)


def _eagle3() -> ExternalDrafterKind:
    from skyrl_mtp.drafters.eagle3_export import check_eagle3_export, is_eagle3_tensor

    return ExternalDrafterKind("eagle3", check_eagle3_export, is_eagle3_tensor)


def _dflash() -> ExternalDrafterKind:
    from skyrl_mtp.drafters.dflash_export import check_dflash_export, is_dflash_tensor

    return ExternalDrafterKind("dflash", check_dflash_export, is_dflash_tensor)


_KINDS = {"eagle3": _eagle3, "dflash": _dflash}
METHODS = tuple(_KINDS)


def drafter_kind(method: str) -> ExternalDrafterKind:
    if method not in _KINDS:
        raise ValueError(f"draft method {method!r} is invalid; allowed: {list(METHODS)}")
    return _KINDS[method]()


def is_external_drafter_tensor(name: str) -> bool:
    """A tensor of any external drafter's export (target checkpoints name theirs ``model.*`` / ``lm_head.weight``)."""
    return any(drafter_kind(m).is_tensor(name) for m in METHODS)
