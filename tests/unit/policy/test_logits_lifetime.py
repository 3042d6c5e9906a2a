"""A training step frees each micro-batch's logits ([rows, tokens, vocab]) once nothing reads them, with the draft
loss on and off: none is alive when an optimizer steps (on a GPU the step is where a recomputing run peaks; the last
micro-batch's logits used to stay there with `train_head=False`, 1.2 GB at 4096 x 151680 bf16)."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from logits_lifetime_rank import run
from mimo_fixture import mimo_config, write_mimo_checkpoint


def test_no_logits_outlive_their_micro_batch(tmp_path):
    ckpt = write_mimo_checkpoint(tmp_path / "ckpt", mimo_config())
    out = tmp_path / "res.pt"
    mp.start_processes(run, args=(str(ckpt), str(out)), nprocs=1, join=True, start_method="spawn")
    res = torch.load(out)
    assert res["head=False"] == {"micro_batches": 2, "alive_at": {"policy": [0]}}
    assert res["head=True"] == {"micro_batches": 2, "alive_at": {"policy": [0], "head": [0]}}
