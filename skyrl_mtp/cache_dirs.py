"""Build-once cache directories that several processes may fill at the same time.

The tiny checkpoints and the warm start are built once and reused (`.cache/`). Two runs, benchmarks or test
processes started side by side may both find the entry missing and both build it: each builds into a folder of
its own and publishes it with one rename; the first complete one stays, a later builder drops its copy (the
builds are seeded, so both are the same).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

COMPLETE = "COMPLETE"


def is_complete(final: Path) -> bool:
    return (final / COMPLETE).exists()


def private_build_dir(final: Path) -> Path:
    """An empty folder beside `final` that no other process builds into."""
    tmp = final.with_name(f"{final.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, final: Path) -> Path:
    """Mark `tmp` complete and move it to `final`, unless another process published `final` first. A folder at
    `final` is only ever put there whole by a rename, so one without the marker is a foreign or interrupted copy:
    it is set aside, never deleted in place (another builder may publish in between)."""
    (tmp / COMPLETE).write_text("ok\n")
    for _ in range(5):
        try:
            tmp.rename(final)   # atomic; refused while `final` holds anything
            return final
        except OSError:
            if is_complete(final):
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            if not final.exists():
                continue
            aside = final.with_name(f"{final.name}.stale-{uuid.uuid4().hex[:8]}")
            try:
                final.rename(aside)
            except OSError:
                continue
            if is_complete(aside):   # published by another builder after the check: put it back
                try:
                    aside.rename(final)
                except OSError:
                    pass
            else:
                shutil.rmtree(aside, ignore_errors=True)
    raise RuntimeError(f"could not publish {tmp} as {final}: another process keeps replacing it")
