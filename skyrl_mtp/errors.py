"""The project's exception types that cross layers, and the one formatter of a bad-value message.

A bad config (`ConfigError`) or an impossible layout (`PlacementError`) is reported before anything
starts; a run stopped on purpose at a known step (`RunStoppedError` and its kinds) names what happened,
the step and the last complete checkpoint (left untouched), so the user can fix the cause and rerun
with trainer.resume=auto. The launcher prints each of them and exits with status 2 or 1.
"""

from __future__ import annotations

from typing import Any


def problem(key: str, value: Any, allowed: str) -> str:
    """One bad-value message: the key as the user (or caller) wrote it, the value, and what is allowed."""
    return f"{key}={value!r} is invalid: {allowed}"


class ConfigError(ValueError):
    """A configuration problem; `problems` holds one line per offending key."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        head = "invalid configuration" if len(problems) != 1 else "invalid configuration:"
        body = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{head}\n{body}" if len(problems) != 1 else f"{head} {problems[0]}")


class PlacementError(ValueError):
    """The requested layout does not fit the Ray cluster; the message has the numbers."""


class RunStoppedError(RuntimeError):
    """The run stopped at a step; the message says why and names the last intact checkpoint."""


class EngineDiedError(RunStoppedError):
    """An inference engine actor died; the message names it and the last intact checkpoint."""


class NonFiniteMetricError(RunStoppedError):
    """A loss or grad norm was NaN or infinite; the message names it, the step and the last intact checkpoint."""
