"""The checker that config validation runs: it collects the problems of a config and the rules it applied.

Every check names its key and says, in one text, what is allowed; that text is both the tail of the error
(`key=value is invalid: <allowed>`) and the rule recorded under the key, whether or not the value passed.
The recorded rules are what docs/config.md shows (config/reference.py), so the reference and the errors
cannot say different things.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from skyrl_mtp.errors import problem


class Checker:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.problems: list[str] = []
        self.rules: dict[str, list[str]] = {}   # key -> what its checks allow, in the order they ran

    def get(self, key: str) -> Any:
        return OmegaConf.select(self.cfg, key)

    def rule(self, key: str, allowed: str) -> None:
        """Record that `key` is checked against `allowed` (for the configuration reference)."""
        texts = self.rules.setdefault(key, [])
        if allowed not in texts:
            texts.append(allowed)

    def add(self, key: str, value: Any, allowed: str) -> None:
        """Record a problem of `key` unless one is already recorded for it."""
        if not self.reported(key):
            self.problems.append(problem(key, value, allowed))

    def reported(self, *keys: str) -> bool:
        return any(p.startswith(f"{k}=") or p.startswith(f"{k}[") for p in self.problems for k in keys)

    def check(self, key: str, ok: Callable[[Any], bool], allowed: str, when: bool = True) -> None:
        """Report `key` unless ok(its value); a check that applies only `when` a condition holds is
        still recorded as a rule of `key` (its text says the condition)."""
        self.rule(key, allowed)
        if not when:
            return
        value = self.get(key)
        if not ok(value):
            self.add(key, value, allowed)

    def choice(self, key: str, choices: tuple[str, ...], optional: bool = False, when: bool = True) -> None:
        self.check(key, lambda v: (optional and v is None) or v in choices,
                   f"must be one of {list(choices)}" + (" or null" if optional else ""), when=when)

    def at_least(self, key: str, low: float, optional: bool = False) -> None:
        self.check(key, lambda v: (optional and v is None) or (v is not None and v >= low),
                   f"must be >= {low}" + (" or null" if optional else ""))

    def existing_path(self, key: str) -> None:
        """Report `key` when it names no existing path; null passes."""
        self.rule(key, "an existing path, or null")
        value = self.get(key)
        if value is not None and not Path(str(value)).exists():
            self.add(key, value, "path does not exist")

    def existing_paths(self, key: str) -> None:
        """Every entry of the list `key` names an existing path (a missing one is reported as key[i])."""
        self.rule(key, "every entry an existing path")
        for i, value in enumerate(self.get(key) or []):
            if not Path(str(value)).exists():
                self.add(f"{key}[{i}]", value, "path does not exist")
