"""Build-once cache folders filled by several processes at once: one complete folder survives, no builder fails."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from skyrl_mtp.cache_dirs import is_complete, private_build_dir, publish


def _build(final: str, payload: str, barrier, results) -> None:
    tmp = private_build_dir(Path(final))
    (tmp / "weights.bin").write_text(payload)
    barrier.wait()   # every builder publishes at the same moment
    results.put((publish(tmp, Path(final)) / "weights.bin").read_text())


@pytest.mark.parametrize("round_", range(3))
def test_concurrent_builders_all_return_the_one_published_folder(tmp_path, round_):
    final = tmp_path / "tiny-abc"
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(6), ctx.Queue()
    procs = [ctx.Process(target=_build, args=(str(final), f"build {i}", barrier, results)) for i in range(6)]
    for p in procs:
        p.start()
    got = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    # every builder got the folder that stays (none was replaced after another builder returned it)
    assert is_complete(final) and len(set(got)) == 1 and got[0] == (final / "weights.bin").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-abc"]   # no builder's folder is left behind


def test_a_half_written_folder_is_replaced(tmp_path):
    final = tmp_path / "warm-1"
    final.mkdir()
    (final / "model.safetensors").write_text("truncated")   # a killed build: no COMPLETE marker
    tmp = private_build_dir(final)
    (tmp / "model.safetensors").write_text("whole")
    assert publish(tmp, final) == final and (final / "model.safetensors").read_text() == "whole"
    assert is_complete(final) and not tmp.exists()
