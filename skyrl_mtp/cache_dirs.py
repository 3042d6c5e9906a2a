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
    """Mark `tmp` complete and move it to `final`, unless another process published `final` first."""
    (tmp / COMPLETE).write_text("ok\n")
    if not is_complete(final):
        shutil.rmtree(final, ignore_errors=True)   # a half-written folder of an older layout or a killed build
        try:
            tmp.rename(final)
            return final
        except OSError:
            if not is_complete(final):
                raise
    shutil.rmtree(tmp, ignore_errors=True)
    return final
