"""Fan-out metric logging: one short console line per step, metrics.jsonl, and optional offline wandb.

Non-finite values are never dropped: metrics.jsonl (strict JSON has no NaN) records them as the strings
"nan", "inf" or "-inf" and lists their keys under `nonfinite_metrics`; wandb receives the float itself.

Resume policy for metrics.jsonl: when `resume_step` is given, lines with step > resume_step are dropped (they
belong to the abandoned run after the checkpoint) and earlier lines are kept; otherwise the file is appended to.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from skyrl_mtp.allowed import LOGGER_BACKENDS as BACKENDS
from skyrl_mtp.allowed import WANDB_MODES
from skyrl_mtp.tracking.console import format_step_line, write_line

NONFINITE_KEY = "nonfinite_metrics"


def _scalar(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


def jsonl_row(metrics: dict[str, Any], step: int) -> dict[str, Any]:
    """The metrics.jsonl row of one step: non-finite floats as "nan" / "inf" / "-inf", their keys listed."""
    row: dict[str, Any] = {"step": step}
    bad = []
    for k, v in metrics.items():
        v = _scalar(v)
        if isinstance(v, float) and not math.isfinite(v):
            bad.append(k)
            v = str(v)
        row[k] = v
    if bad:
        row[NONFINITE_KEY] = sorted(bad)
    return row


def _parse_line(line: str) -> dict | None:
    # a line cut short by a crash mid-write is dropped on resume
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


@dataclass(frozen=True)
class TrackerConfig:
    """The run's logging settings (built from `logger.*` by skyrl_mtp.trainer.run_plan.tracker_config)."""

    backends: tuple[str, ...] = ("console", "jsonl")
    project: str = "skyrl-mtp"
    run_name: str = "default"
    wandb_mode: str = "offline"      # passed to wandb.init(mode=...); the WANDB_MODE variable is not read
    plots: bool = True               # PNG plots of metrics.jsonl at the end of a run
    verbose: bool = False            # false: library logs at WARNING, known harmless warnings hidden


class Tracker:
    @classmethod
    def from_config(cls, out_dir: str | Path, tc: TrackerConfig, *, config: dict | None = None,
                    resume_step: int | None = None, stream: TextIO | None = None) -> Tracker:
        return cls(out_dir, tc.backends, project=tc.project, run_name=tc.run_name, wandb_mode=tc.wandb_mode,
                   config=config, resume_step=resume_step, stream=stream)

    def __init__(
        self,
        out_dir: str | Path,
        backends: tuple[str, ...] = ("console", "jsonl"),
        *,
        project: str = "skyrl-mtp",
        run_name: str | None = None,
        wandb_mode: str = "offline",
        config: dict | None = None,
        resume_step: int | None = None,
        stream: TextIO | None = None,
    ) -> None:
        bad = [b for b in backends if b not in BACKENDS]
        if bad:
            raise ValueError(f"backends={backends} contains unknown {bad}; allowed: {BACKENDS}")
        if wandb_mode not in WANDB_MODES:
            raise ValueError(f"wandb_mode={wandb_mode!r} is invalid: allowed: {WANDB_MODES}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.backends = backends
        self.stream = stream or sys.stdout
        self.jsonl_path = self.out_dir / "metrics.jsonl"
        self._fh = None
        if "jsonl" in backends:
            if resume_step is not None and self.jsonl_path.exists():
                kept = [ln for ln in self.jsonl_path.read_text().splitlines()
                        if (row := _parse_line(ln)) is not None and row.get("step", -1) <= resume_step]
                self.jsonl_path.write_text("".join(ln + "\n" for ln in kept))
            self._fh = self.jsonl_path.open("a")
        self._wandb = None
        if "wandb" in backends:
            try:
                import wandb

                self._wandb = wandb.init(project=project, name=run_name, config=config or {},
                                         dir=str(self.out_dir), mode=wandb_mode)
            except Exception as e:  # wandb is optional; never crash training for it
                warnings.warn(f"wandb init failed, continuing without it: {e}", stacklevel=2)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        values = {k: _scalar(v) for k, v in metrics.items()}
        if "console" in self.backends:
            write_line(format_step_line(step, values), self.stream)
        if self._fh is not None:
            self._fh.write(json.dumps(jsonl_row(values, step), allow_nan=False) + "\n")
            self._fh.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"metrics file not found: {p}")
    return [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]
