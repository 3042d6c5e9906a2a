"""The run directory: where a run's config, metrics and checkpoints live, and how resume finds them.

Checkpoints are written to a temporary sibling and renamed into place only when complete, so a
crash mid-save never leaves a half-written `step_N` that resume would pick up; pruning removes
only complete checkpoints older than the newest `keep_last`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from omegaconf import OmegaConf

from skyrl_mtp.config.run_dir_check import CHECKPOINTS_DIR, COMPLETE_MARKER, METRICS_FILE, complete_steps


class RunDir:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def metrics_file(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    def create(self, config: dict) -> None:
        """The directory, with the run's resolved config (plain containers) as config.yaml."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.checkpoints.mkdir(exist_ok=True)
        (self.root / "config.yaml").write_text(OmegaConf.to_yaml(config))

    def step_dir(self, step: int) -> Path:
        return self.checkpoints / f"step_{step}"

    def staging_dir(self, step: int) -> Path:
        path = self.checkpoints / f".tmp_step_{step}"
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        return path

    def commit(self, staging: Path, step: int, trainer_state: dict, keep_last: int) -> Path:
        (staging / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
        (staging / COMPLETE_MARKER).write_text(str(step))
        final = self.step_dir(step)
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
        self._prune(keep_last)
        return final

    def complete_steps(self) -> list[int]:
        return complete_steps(self.root)

    def latest(self) -> Path | None:
        steps = self.complete_steps()
        return self.step_dir(steps[-1]) if steps else None

    def _prune(self, keep_last: int) -> None:
        for step in self.complete_steps()[:-keep_last]:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)


def read_trainer_state(ckpt: Path) -> dict:
    return json.loads((ckpt / "trainer_state.json").read_text())
