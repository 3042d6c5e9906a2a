"""Random DAPO training batches of a chosen shape: a real policy train step without rollouts.

Why this exists: policy tests (one rank, DP=2 over processes and over Ray nodes, GPU) and the training
benchmarks all need the same kind of batch: random token ids, a prompt masked out of the loss, old
logprobs near the tiny model's own, and one advantage per sequence. One definition keeps them alike.
"""

from __future__ import annotations

import torch


def random_dapo_batch(generator: torch.Generator, batch: int, seq_len: int, *, vocab: int = 512,
                      prompt_len: int | None = None, old_logprob: float = -5.0) -> dict[str, torch.Tensor]:
    """`batch` sequences of `seq_len` tokens; the first `prompt_len` (default a quarter) are prompt."""
    prompt = seq_len // 4 if prompt_len is None else prompt_len
    if not 0 <= prompt < seq_len:
        raise ValueError(f"prompt_len={prompt_len} is invalid: expected 0 <= prompt_len < seq_len={seq_len}")
    ids = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    loss_mask = torch.zeros(batch, seq_len)
    loss_mask[:, prompt:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones(batch, seq_len, dtype=torch.long), "loss_mask": loss_mask,
            "old_logprobs": torch.full((batch, seq_len), old_logprob),
            "advantages": torch.randn(batch, 1, generator=generator).expand(batch, seq_len).clone()}


def random_dapo_batches(count: int, seed: int, batch: int, seq_len: int, **kwargs) -> list[dict[str, torch.Tensor]]:
    """`count` batches, batch i drawn from a generator seeded `seed + i`."""
    return [random_dapo_batch(torch.Generator().manual_seed(seed + i), batch, seq_len, **kwargs)
            for i in range(count)]
