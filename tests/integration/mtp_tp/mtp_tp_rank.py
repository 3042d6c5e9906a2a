"""One tensor-parallel rank of the draft-loss TP test: real torch.distributed (gloo), its vocab shard only.

Spawned by test_mtp_tp_draft_losses.py; writes every loss, count and gradient it computed to
``<out_dir>/rank<r>.pt`` for the test process to compare with the TP=1 computation.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from skyrl_mtp.mtp.draft_losses import DRAFT_LOSS_TYPES, chunked_draft_loss, draft_loss, expected_acceptance

TOPK = 3
CHUNK = 4


def shard_bounds(shards: tuple[int, ...], rank: int) -> tuple[int, int]:
    start = sum(shards[:rank])
    return start, start + shards[rank]


def run_rank(rank: int, world: int, port: int, data_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))
        results = {}
        for name, case in torch.load(data_path).items():
            lo, hi = shard_bounds(case["shards"], rank)
            kw = dict(tp_group=group, vocab_start_index=lo, vocab_size=case["vocab_size"], topk=TOPK,
                      target_ids=case["target"])
            teacher = case["teacher"][:, lo:hi]
            for lt in DRAFT_LOSS_TYPES:
                s = case["student"][:, lo:hi].clone().requires_grad_()
                out = draft_loss(s, teacher, case["mask"], loss_type=lt, **kw)
                out.loss_sum.backward()
                h = case["hidden"].clone().requires_grad_()
                w = case["weight"][lo:hi].clone().requires_grad_()
                ch = chunked_draft_loss(h, w, teacher, case["mask"], chunk_size=CHUNK, loss_type=lt, **kw)
                ch.loss_sum.backward()
                results[(name, lt)] = dict(
                    loss=out.loss_sum.detach(), num=out.num_tokens, agree=out.top1_agree, grad=s.grad,
                    chunked_loss=ch.loss_sum.detach(), chunked_agree=ch.top1_agree, hidden_grad=h.grad,
                    weight_grad=w.grad)
            results[(name, "acceptance")] = expected_acceptance(
                teacher, case["student"][:, lo:hi], tp_group=group, vocab_start_index=lo,
                vocab_size=case["vocab_size"])
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
