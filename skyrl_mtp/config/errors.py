"""The one exception type for bad configuration, so the CLI can print every problem at once."""

from __future__ import annotations

from skyrl_mtp.allowed import problem

__all__ = ["ConfigError", "problem"]


class ConfigError(ValueError):
    """A configuration problem; `problems` holds one line per offending key."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        head = "invalid configuration" if len(problems) != 1 else "invalid configuration:"
        body = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{head}\n{body}" if len(problems) != 1 else f"{head} {problems[0]}")


