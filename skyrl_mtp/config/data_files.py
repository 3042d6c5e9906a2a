"""Checks of a run's data at validation: the files' format and layout (read from their first row only), and the
settings that must agree with where the prompts come from (the environment, the warm start).

A run reads `data.train_files` / `data.val_files` in the DAPO-Math layout (environment math, or the synthetic
search task) or the Search-R1 layout (environment search); docs/data.md describes both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from skyrl_mtp.config.checker import Checker

# the environment each synthetic task is scored by
SYNTHETIC_ENVIRONMENT = {"arithmetic": "math", "search": "search"}


def data_layout(cfg: Any) -> str:
    """The row layout of the user's data files: searchr1 for the search environment, else dapo."""
    return "searchr1" if cfg.environment.name == "search" and cfg.data.synthetic != "search" else "dapo"


def first_row(path: Path) -> dict | None:
    """The first row of a parquet / JSONL / JSON file (None when it has none); raises ValueError or OSError."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=1):
            rows = batch.to_pylist()
            if rows:
                return rows[0]
        return None
    with path.open(encoding="utf-8") as f:
        head = f.read(1)
        if head == "[":   # a JSON array of rows
            rows = json.loads(head + f.read())
            return rows[0] if rows else None
        for line in (head + f.readline(), *f):
            if line.strip():
                return json.loads(line)
    return None


def data_file_checks(c: Checker) -> None:
    """Every data file: a suffix the loader reads and a first row in the run's layout."""
    from skyrl_mtp.data.datasets import DATA_FILE_KINDS, parse_row

    layout = data_layout(c.cfg)
    for key in ("data.train_files", "data.val_files"):
        c.rule(key, f"every entry a {sorted(DATA_FILE_KINDS)} file whose rows are in the run's layout "
                    "(dapo: environment math or data.synthetic=search; searchr1: environment search; docs/data.md)")
        for i, value in enumerate(c.get(key) or []):
            item = f"{key}[{i}]"
            path = Path(str(value))
            if c.reported(item) or not path.is_file():
                continue
            if path.suffix not in DATA_FILE_KINDS:
                c.add(item, str(value), f"must be a file ending in one of {sorted(DATA_FILE_KINDS)}")
                continue
            try:
                row = first_row(path)
                if row is None:
                    c.add(item, str(value), "has no rows")
                    continue
                parse_row(row, 0, layout)
            except (OSError, ValueError) as err:   # unreadable, not JSON / parquet, or not the layout
                c.add(item, str(value), f"must hold rows in the {layout} layout (docs/data.md): {err}")


def data_source_checks(c: Checker) -> None:
    """Settings that must agree with the prompts' source: the environment and the warm start."""
    cfg = c.cfg
    synthetic = cfg.data.synthetic
    want = SYNTHETIC_ENVIRONMENT.get(synthetic)
    c.rule("environment.name", f"with data.synthetic set, the environment that scores that task: "
                               f"{SYNTHETIC_ENVIRONMENT}")
    name = c.get("environment.name")
    if want is not None and name != want and not c.reported("data.synthetic", "environment.name"):
        c.add("environment.name", name, f"must be {want!r} with data.synthetic={synthetic!r} (the environment that "
                                        f"scores that task; synthetic tasks and their environments: "
                                        f"{SYNTHETIC_ENVIRONMENT})")
    c.check("trainer.warm_start.enabled", lambda v: not v,
            "must be false unless data.synthetic is set: the warm start trains on the synthetic task's reference "
            "answers (data.synthetic=arithmetic|search), which user data files do not have",
            when=synthetic is None)
