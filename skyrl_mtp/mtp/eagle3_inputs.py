"""What an EAGLE-3 drafter trains on at depth 1, shaped from one policy forward's captured layer states.

vLLM's EAGLE-3 proposer (vllm/v1/spec_decode/llm_base_proposer.py, ``set_inputs_first_pass``) runs the drafter at
each target position t on: the target's aux hidden states at t concatenated in ascending layer-id order
(``combine_hidden_states`` then projects them to H), the token t+1 (the input ids "rotated by one"), and the
target's position t unchanged; the drafter's output at t drafts token t+2. That is the MTP head of depth 1, so the
trained positions, the teacher and the hard target are the MTP head's (draft_head.compute_draft_loss at d = 1):
positions from ``draft_positions(loss_mask, 1, ...)`` (t+2 a trained token of t's own segment), the policy's
next-token logits at t+1 (detached) as the soft target, and the sampled token t+2 as the hard one. The drafter's
attention runs over every position of a row; only the returned ``rows, cols`` enter the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_mtp.mtp.draft_head import draft_positions
from skyrl_mtp.mtp.layer_capture import CapturedLayerStates
from skyrl_mtp.mtp.masks import shift_left


@dataclass(frozen=True)
class Eagle3TrainingInputs:
    hidden: torch.Tensor      # [B, S, n*H] the captured states at t, concatenated in ascending layer id, detached
    input_ids: torch.Tensor   # [B, S] the drafter's input token at t: token t+1 (0 at the last position)
    rows: torch.Tensor        # [N] row of each trained position
    cols: torch.Tensor        # [N] position t of each trained position (its draft is token t+2)
    target_ids: torch.Tensor  # [N] the sampled token t+2 (hard_ce's target)

    def teacher_logits(self, policy_logits: torch.Tensor) -> torch.Tensor:
        """The soft target [N, V_local]: the policy's (detached) next-token logits at t+1, read in place."""
        return policy_logits.detach()[self.rows, self.cols + 1]


def eagle3_training_inputs(captured: CapturedLayerStates, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                           segment_ids: torch.Tensor | None = None,
                           position_fraction: float = 1.0) -> Eagle3TrainingInputs:
    """The depth-1 EAGLE-3 training inputs of one micro-batch; ``captured`` states are [S, B, H] each
    (LayerHiddenCapture), ``input_ids`` / ``loss_mask`` / ``segment_ids`` [B, S]; ``position_fraction`` thins the
    trained positions exactly as the MTP draft loss does (DraftLossSpec.position_fraction)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids.shape={tuple(input_ids.shape)} is invalid: expected [B, S]")
    if tuple(loss_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"loss_mask.shape={tuple(loss_mask.shape)} is invalid: expected the shape of input_ids "
                         f"{tuple(input_ids.shape)}")
    if not captured.states:
        raise ValueError("captured.states is empty: expected one [S, B, H] state per captured layer")
    b, s = input_ids.shape
    for lid, state in zip(captured.layer_ids, captured.states):
        if state.dim() != 3 or tuple(state.shape[:2]) != (s, b):
            raise ValueError(f"captured state of layer id {lid} has shape {tuple(state.shape)}: expected "
                             f"[S, B, H] = [{s}, {b}, H] (the layout LayerHiddenCapture records)")
    hidden = torch.cat([state.detach().transpose(0, 1) for state in captured.states], dim=-1)
    rows, cols = draft_positions(loss_mask, 1, segment_ids, input_ids, position_fraction)
    return Eagle3TrainingInputs(hidden=hidden, input_ids=shift_left(input_ids, 1, 0), rows=rows, cols=cols,
                                target_ids=input_ids[rows, cols + 2])
