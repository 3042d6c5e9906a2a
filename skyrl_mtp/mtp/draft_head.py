"""Detached replay of the MTP head and its draft loss against the policy's own distribution.

The replay feeds each MTP layer exactly what the model family's vLLM drafter is fed
(``ModelFamily.mtp_replay_inputs``: which trunk hidden state, whether the embedding is zeroed at
position 0, what depth d > 1 receives and which layer runs it). Trunk hidden, re-embedding and the
output projection weight are detached, so the gradient of the draft loss reaches MTP parameters only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from skyrl_mtp.mtp.capture import CapturedMTPInputs


@dataclass
class DraftLossSpec:
    loss_type: str = "soft_ce"
    num_depths: int = 1
    topk: int = 32
    chunk_size: int | str = 0   # tokens per chunk; 0: one chunk; auto: draft_losses.chunk_tokens
    # < 1: the cheaper loss, on about this fraction of each sequence's draft positions (a hash of the
    # position, the depth and the batch's tokens picks them, so every TP rank picks the same ones and
    # successive batches cover different positions); the trunk-side replay still runs on all positions
    position_fraction: float = 1.0
    # depth d's loss and its positions weigh depth_decay ** (d - 1) (< 1 favours the first depths: depth
    # d's draft is verified only when depths 1..d-1 were accepted)
    depth_decay: float = 1.0
    # the vLLM model runner whose drafter the replay follows: which MTP layer runs depth d (MTPReplayInputs)
    runner: str = "v1"


@dataclass
class DraftResult:
    loss_sum: torch.Tensor  # differentiable, summed over valid positions and depths (depths weighted)
    num_tokens: torch.Tensor  # valid positions, summed over depths (depths weighted)
    per_depth: list[tuple[float, float, float]]  # (loss_sum, num_tokens, top1_agree) per depth, unweighted


def depth_weights(num_depths: int, decay: float) -> list[float]:
    """The draft loss weight of depths 1..num_depths: decay ** (d - 1)."""
    return [decay ** (d - 1) for d in range(1, num_depths + 1)]


def _tp_info():
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None, 0, 1
    group = parallel_state.get_tensor_model_parallel_group()
    return group, parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def output_weight(model) -> torch.Tensor:
    if getattr(model, "share_embeddings_and_output_weights", False):
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def _shift_ids(input_ids: torch.Tensor, shift: int) -> torch.Tensor:
    out = torch.zeros_like(input_ids)
    if shift < input_ids.shape[1]:
        out[:, : input_ids.shape[1] - shift] = input_ids[:, shift:]
    return out


_HASH_MOD = 1 << 20


def draft_positions(loss_mask: torch.Tensor, depth: int, segment_ids, input_ids: torch.Tensor,
                    position_fraction: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of the positions whose depth-``depth`` draft is trained: the draft mask, thinned to
    ``position_fraction`` of them (position_subset)."""
    from skyrl_mtp.mtp.masks import draft_position_mask

    mask = draft_position_mask(loss_mask, depth, segment_ids)
    if position_fraction < 1.0:
        mask = mask & position_subset(input_ids, depth, position_fraction)
    return mask.nonzero(as_tuple=True)


def position_subset(input_ids: torch.Tensor, depth: int, position_fraction: float) -> torch.Tensor:
    """Bool [B, S]: a deterministic ``position_fraction`` of each row's positions, keyed on the row's own
    tokens, the position and the depth. A row keeps the same positions whichever micro-batch or rank holds
    it, so the normaliser counted over the whole batch (draft_normaliser) is the number of positions the
    micro-batches train; device tensor ops only (no host sync). Consecutive positions step through the hash
    by a fixed odd stride, so each row keeps close to ``position_fraction`` of any run of positions."""
    s = input_ids.shape[1]
    salt = input_ids.long().sum(dim=1, keepdim=True) % _HASH_MOD                      # [B, 1]
    pos = torch.arange(s, device=input_ids.device).unsqueeze(0)                        # [1, S]
    h = (pos * 2654435761 + depth * 40503 + salt * 97) % _HASH_MOD
    return h < int(position_fraction * _HASH_MOD)


def draft_normaliser(loss_mask: torch.Tensor, segment_ids, input_ids: torch.Tensor, spec: DraftLossSpec) -> float:
    """The positions the draft loss covers in this batch, each depth counted at its weight: the loss is a
    weighted mean over them."""
    weights = depth_weights(spec.num_depths, spec.depth_decay)
    return sum(w * float(draft_positions(loss_mask, d, segment_ids, input_ids, spec.position_fraction)[0].numel())
               for d, w in enumerate(weights, start=1))


def replay_mtp_hidden(model, captured: CapturedMTPInputs, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      num_depths: int, inputs=None, runner: str = "v1") -> list[torch.Tensor]:
    """Final-normed MTP outputs [S, B, H] for depths 1..num_depths (gradient reaches MTP params only).

    ``inputs``: the family's ``MTPReplayInputs``; by default those of the family the model was built for, as
    vLLM's ``runner`` drafts with them (V1: layer 0 at every depth; V2 with several layers: layer d-1).
    """
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from skyrl_mtp.models.families.megatron_common import mtp_inner_layer_name

    inner = mtp_inner_layer_name()
    if inputs is None:
        from skyrl_mtp.models.families import family_of_model

        inputs = family_of_model(model).mtp_replay_inputs.for_runner(runner, len(model.mtp.layers), num_depths)
    layers = model.mtp.layers
    kw = captured.mtp_kwargs
    hidden = captured.prenorm_hidden.detach()
    if inputs.hidden == "post_norm":
        with torch.no_grad():
            hidden = model.decoder.final_layernorm(hidden).detach()
    outs = []
    for d in range(1, num_depths + 1):
        layer = layers[inputs.layer_index(d, len(layers))]
        with torch.no_grad():
            ids = _shift_ids(input_ids, d)
            emb = model.embedding(input_ids=ids, position_ids=position_ids).detach()  # [S, B, H]
            if d == 1 and inputs.zero_embedding_at_position_0:
                emb = torch.where((position_ids == 0).t().unsqueeze(-1), torch.zeros_like(emb), emb)
        x = torch.cat([layer.enorm(emb), layer.hnorm(hidden)], dim=-1)
        x, _ = layer.eh_proj(x)
        x = gather_from_tensor_model_parallel_region(x)
        x, _ = getattr(layer, inner)(hidden_states=x, attention_mask=kw.get("attention_mask"),
                                     rotary_pos_emb=kw.get("rotary_pos_emb"))
        normed = layer.final_layernorm(x)
        outs.append(normed)
        # depth d+1 is fed depth d's output: final-normed ("previous_output") or before the norm
        hidden = normed if inputs.deeper_hidden == "previous_output" else x
    return outs


def draft_logits(model, mtp_hidden: torch.Tensor) -> torch.Tensor:
    """Local-vocab-shard logits [B, S, V_local] through the detached output weight."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    h = copy_to_tensor_model_parallel_region(mtp_hidden)
    return F.linear(h, output_weight(model).detach()).transpose(0, 1)


def projected_draft_loss(student_hidden: torch.Tensor, weight: torch.Tensor, teacher: torch.Tensor,
                         target: torch.Tensor, chunk: int, **kwargs):
    """The draft loss (draft_losses.py) of [N, H] student hidden states projected through ``weight`` [V_local, H]
    against ``teacher`` [N, V_local] and the sampled ``target`` [N]: chunk by chunk when ``chunk`` > 0."""
    from skyrl_mtp.mtp.draft_losses import chunked_draft_loss, draft_loss

    valid = torch.ones(student_hidden.shape[0], dtype=torch.bool, device=student_hidden.device)
    if chunk > 0:
        return chunked_draft_loss(student_hidden, weight, teacher, valid, chunk_size=chunk, target_ids=target, **kwargs)
    return draft_loss(F.linear(student_hidden, weight), teacher, valid, target_ids=target, **kwargs)


class DepthSums:
    """Depth by depth: the weighted loss and token sums of a DraftResult, and each depth's unweighted stats."""

    def __init__(self):
        self.total = self.count = None
        self.per_depth: list[tuple[float, float, float]] = []

    def add(self, out, weight: float) -> None:
        loss_sum, num_tokens = out.loss_sum * weight, out.num_tokens * weight   # x * 1.0 is exact
        self.total = loss_sum if self.total is None else self.total + loss_sum
        self.count = num_tokens if self.count is None else self.count + num_tokens
        self.per_depth.append((float(out.loss_sum.detach()), float(out.num_tokens), float(out.top1_agree)))

    def result(self) -> DraftResult:
        return DraftResult(self.total, self.count, self.per_depth)


def compute_draft_loss(model, captured: CapturedMTPInputs, policy_logits: torch.Tensor, batch: dict,
                       spec: DraftLossSpec, vocab_size: int) -> DraftResult:
    """Draft loss of depths 1..num_depths; ``policy_logits`` [B, S, V_local] is the teacher (detached here).

    Only the positions the mask keeps are projected to the vocabulary: the head's hidden states, the
    teacher rows (the policy's logits at t + d, read in place, never shifted or copied whole) and the
    sampled targets are gathered first, so prompt, padding and tool-output positions cost nothing
    beyond the replayed block itself.
    """
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    from skyrl_mtp.mtp.draft_losses import chunk_tokens

    tp_group, tp_rank, tp_size = _tp_info()
    v_local = policy_logits.shape[-1]
    chunk = chunk_tokens(spec.chunk_size, v_local)
    kwargs = dict(loss_type=spec.loss_type, topk=spec.topk, tp_group=tp_group if tp_size > 1 else None,
                  vocab_start_index=tp_rank * v_local, vocab_size=vocab_size)
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    segment_ids = batch.get("segment_ids")
    hidden = replay_mtp_hidden(model, captured, input_ids, batch["position_ids"], spec.num_depths, runner=spec.runner)
    teacher_all = policy_logits.detach()
    weight = output_weight(model).detach()
    sums = DepthSums()
    for d, (h, w) in enumerate(zip(hidden, depth_weights(spec.num_depths, spec.depth_decay)), start=1):
        rows, cols = draft_positions(loss_mask, d, segment_ids, input_ids, spec.position_fraction)
        teacher = teacher_all[rows, cols + d]  # the policy's next-token logits at t + d: [n, V_local]
        target = input_ids[rows, cols + 1 + d]  # the sampled token the head predicts
        student_hidden = copy_to_tensor_model_parallel_region(h[cols, rows])  # h is [S, B, H]
        sums.add(projected_draft_loss(student_hidden, weight, teacher, target, chunk, **kwargs), w)
    return sums.result()
