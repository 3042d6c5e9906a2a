"""Errors that stop a run on purpose at a known step; the launcher prints them and exits with status 1.

Each message names what happened, the step, and the last complete checkpoint (left untouched), so the
user can fix the cause and rerun with trainer.resume=auto.
"""

from __future__ import annotations


class RunStoppedError(RuntimeError):
    """The run stopped at a step; the message says why and names the last intact checkpoint."""


class EngineDiedError(RunStoppedError):
    """An inference engine actor died; the message names it and the last intact checkpoint."""


class NonFiniteMetricError(RunStoppedError):
    """A loss or grad norm was NaN or infinite; the message names it, the step and the last intact checkpoint."""
