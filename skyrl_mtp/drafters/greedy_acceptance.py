"""What greedy speculative decoding with a drafter accepts on sequences whose greedy continuation is known, counted
the way vLLM's engine counts it, so a trainer's prediction can be compared with vLLM's Prometheus counters
(``vllm:spec_decode_num_drafts`` and ``..._num_accepted_tokens_per_pos``).

The walk (vLLM 0.32's V1 scheduler and runner, greedy target, k drafts per step): the prefill samples the first
token, and the drafter proposes from the last prompt index P-1; each later step verifies the k drafts, keeps the
a leading ones that equal the target's greedy tokens plus one token of its own (a + 1 tokens), counts one draft
of k tokens and a hit at positions 1..a, and proposes again from the new last index. A request stops once it
has its max_tokens; its last step's drafts are counted in full even when they reach past max_tokens (vLLM
trims the output, not the counters), so the sequences must hold k tokens beyond max_tokens.
The walk is the same for DFlash (one parallel proposal of k drafts per step); only the drafts differ
(``dflash_greedy_drafts``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from skyrl_mtp.drafters.dflash import DFlashDrafter, block_hidden
from skyrl_mtp.drafters.eagle3 import Eagle3Drafter, unroll


@torch.no_grad()
def eagle3_greedy_drafts(drafter: Eagle3Drafter, aux_hidden: torch.Tensor, input_ids: torch.Tensor,
                         embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T, k]: the k tokens vLLM's EAGLE-3 proposer drafts from each index t of ``input_ids`` (see unroll)."""
    outs = unroll(drafter, aux_hidden, input_ids, embed_weight, k, greedy_lm_head=lm_head_weight)
    return torch.stack([torch.nn.functional.linear(o.hidden, lm_head_weight).argmax(-1) for o in outs], dim=-1)


def accepted_lengths(drafts: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, T]: how many leading drafts from index t equal the sequence (draft i is of the token at t + 2 + i);
    a draft past the end of the sequence counts as wrong."""
    b, t, k = drafts.shape
    hits = torch.zeros(b, t, k, dtype=torch.bool, device=drafts.device)
    for i in range(k):
        n = max(t - 2 - i, 0)
        hits[:, :n, i] = drafts[:, :n, i] == input_ids[:, 2 + i:2 + i + n]
    return hits.long().cumprod(-1).sum(-1)


def simulate_greedy_spec_decode(accepted: torch.Tensor, prompt_len: int, max_tokens: int,
                                k: int) -> tuple[int, list[int]]:
    """(drafts, accepted per draft position) over the rows of ``accepted`` [B, T] (accepted_lengths of prompt +
    greedy continuation, P = prompt_len) for requests of ``max_tokens`` new tokens, as vLLM counts them."""
    drafts, per_pos = 0, [0] * k
    for row in accepted.tolist():
        index, generated = prompt_len - 1, 1
        while generated < max_tokens:
            a = row[index]
            drafts += 1
            for i in range(a):
                per_pos[i] += 1
            generated += a + 1
            index += a + 1
    return drafts, per_pos


@torch.no_grad()
def dflash_greedy_drafts(drafter: DFlashDrafter, aux_hidden: torch.Tensor, input_ids: torch.Tensor,
                         embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T, k]: the k tokens vLLM's DFlash proposer drafts from each index t of ``input_ids`` (context = the
    target's states at 0..t, anchor ids[t+1], one block of k masks; draft i of the token at t + 2 + i, so
    ``accepted_lengths`` and ``simulate_greedy_spec_decode`` apply as for EAGLE-3). aux_hidden [B, T, n_ids * H]:
    the target's hidden states at the drafter's target_layer_ids. The last index has no anchor: its row is -1."""
    b, t = input_ids.shape
    drafts = input_ids.new_full((b, t, k), -1)
    if t < 2:
        return drafts
    anchors = torch.arange(1, t, device=input_ids.device).expand(b, t - 1)
    hidden = block_hidden(drafter, aux_hidden, input_ids, embed_weight, anchors, block_size=k + 1)
    drafts[:, :t - 1] = F.linear(hidden[:, :, 1:], lm_head_weight).argmax(-1)
    return drafts
