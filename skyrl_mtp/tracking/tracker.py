"""Fan-out metric logging: compact console line, metrics.jsonl, and optional offline wandb.

Resume policy for metrics.jsonl: when `resume_step` is given, lines with step > resume_step are dropped (they
belong to the abandoned run after the checkpoint) and earlier lines are kept; otherwise the file is appended to.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, TextIO

BACKENDS = ("console", "jsonl", "wandb")


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _parse_line(line: str) -> dict | None:
    # a line cut short by a crash mid-write is dropped on resume
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


class Tracker:
    def __init__(
        self,
        out_dir: str | Path,
        backends: tuple[str, ...] = ("console", "jsonl"),
        *,
        project: str = "skyrl-mtp",
        run_name: str | None = None,
        config: dict | None = None,
        resume_step: int | None = None,
        stream: TextIO | None = None,
    ) -> None:
        bad = [b for b in backends if b not in BACKENDS]
        if bad:
            raise ValueError(f"backends={backends} contains unknown {bad}; allowed: {BACKENDS}")
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

                os.environ.setdefault("WANDB_MODE", "offline")
                self._wandb = wandb.init(project=project, name=run_name, config=config or {},
                                         dir=str(self.out_dir), mode=os.environ["WANDB_MODE"])
            except Exception as e:  # wandb is optional; never crash training for it
                warnings.warn(f"wandb init failed, continuing without it: {e}", stacklevel=2)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        clean = {k: _clean(v) for k, v in metrics.items()}
        if "console" in self.backends:
            parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(clean.items())]
            print(f"[step {step}] " + " ".join(parts), file=self.stream, flush=True)
        if self._fh is not None:
            self._fh.write(json.dumps({"step": step, **clean}) + "\n")
            self._fh.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

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
