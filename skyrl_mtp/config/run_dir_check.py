"""What a run directory holds, as far as validation needs to know before anything is written to it.

`trainer.resume=never` refuses a run directory that already holds a run (metrics or a complete checkpoint); the
layout named here (metrics.jsonl, checkpoints/step_N/COMPLETE) is the one trainer/run_dir.py writes.
"""

from __future__ import annotations

import re
from pathlib import Path

from skyrl_mtp.config.checker import Checker

METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE_MARKER = "COMPLETE"


def complete_steps(root: str | Path) -> list[int]:
    """The steps of the complete checkpoints in run directory `root`, ascending."""
    ckpts = Path(root) / CHECKPOINTS_DIR
    if not ckpts.is_dir():
        return []
    steps = []
    for child in ckpts.iterdir():
        match = STEP_DIR.match(child.name)
        if match and (child / COMPLETE_MARKER).exists():
            steps.append(int(match.group(1)))
    return sorted(steps)


def holds_a_run(root: str | Path) -> bool:
    return (Path(root) / METRICS_FILE).exists() or bool(complete_steps(root))


def run_dir_checks(c: Checker) -> None:
    c.check("trainer.run_dir", lambda v: not holds_a_run(str(v)),
            "must not hold a run already when trainer.resume=never (it would be overwritten); choose a new run_dir "
            "or set trainer.resume=auto to continue it", when=c.get("trainer.resume") == "never")
