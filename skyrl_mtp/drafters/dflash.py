"""The DFlash drafter: a few Qwen3-shaped layers that fill a block of mask tokens in one non-causal pass, reading
the target's hidden states as attention context, computing exactly what vLLM 0.32 computes for
``speculative_config={"method": "dflash"}`` (vllm/model_executor/models/qwen3_dflash.py, DFlashQwen3ForCausalLM,
driven by vllm/v1/spec_decode/dflash.py, DFlashProposer).

What vLLM does for one proposal, step by step (so the trainer can replay it):

- The target emits its hidden states at the drafter's ``target_layer_ids`` (0-based; vLLM adds 1 in
  ``get_eagle3_aux_layers_from_config`` (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py) and captures them as
  EAGLE-3 aux states: id L+1 = the residual stream AFTER target layer L, before any final norm), concatenated in
  the listed order: ``aux [.., n_ids * H]``.
- SpecDecodeBaseProposer.propose (llm_base_proposer.py) calls ``combine_hidden_states``: ``fc(aux)`` (no norm
  before fc). DFlashProposer.set_inputs_first_pass keeps these as the CONTEXT (one row per target position just
  verified; earlier positions' rows are already in the drafter's KV cache) and builds the QUERY block: the token
  just sampled (the anchor, at position p = last verified position + 1) followed by ``k`` =
  num_speculative_tokens copies of ``mask_token_id`` at positions p+1..p+k (utils.py
  copy_and_expand_dflash_inputs_kernel).
- build_model_inputs_first_pass -> DFlashQwen3Model.precompute_and_store_context_kv: ``c = hidden_norm(fc(aux))``
  (_project_context_kv), then for EVERY drafter layer l the context keys ``k_norm_l(k_proj_l(c))`` with RoPE at the
  context positions and values ``v_proj_l(c)``, written into layer l's KV cache (the layer's input_layernorm is
  NOT applied to the context; one ``c`` feeds all layers).
- The query pass (DFlashQwen3Model.forward over the 1 + k block tokens): ``x = embed(block)`` (the TARGET's
  embed_tokens; mask slots embed row ``mask_token_id``); per layer (DFlashQwen3DecoderLayer): input_layernorm
  (fused with the residual add from layer 2 on), q/k/v projections, per-head q_norm / k_norm, RoPE at the block
  positions, attention of every block query over ALL context keys of the request (positions < p) and ALL block
  keys (non-causal: the draft config sets no ``layer_types`` / ``causal``, so _dflash_layer_causal is False and
  the CPU backend runs with ``causal=False``), o_proj, residual add + post_attention_layernorm, SwiGLU MLP;
  finally the residual add and the drafter's ``norm``.
- Draft i (1 <= i <= k) is the argmax of the TARGET's lm_head on the output at mask slot i (token_indices_to_sample
  skips the anchor slot): the draft of the token at position p+i. One pass drafts all k tokens (parallel
  drafting); the anchor slot's output is unused.
- No lm_head / embed_tokens in the checkpoint: vLLM shares the target's (SpecDecodeBaseProposer.
  _maybe_share_embeddings / _maybe_share_lm_head). So the module has neither; the caller passes the target's
  embedding in and applies the target's lm_head weight to the output.

Indexing used here: a proposal made once the target has verified positions 0..t is "from index t"; its anchor
is ``ids[t+1]`` at position t+1 and its drafts are of ``ids[t+2..t+1+k]`` (the EAGLE-3 simulation's convention,
so greedy_acceptance.accepted_lengths applies as is).

The training form (``block_hidden``) runs many anchors at once: one context pass over the whole sequence (fc,
hidden_norm, per-layer context K/V for every position) and one query pass over all blocks, block n attending to
the context keys at positions < its anchor position and to its own block's keys only. Per block that is exactly
the keys vLLM's proposal sees (the drafter's cache at positions < p holds the context rows of those positions, each
written when its token was verified), so each block's output equals ``propose`` on the same sequence cut at
its anchor (tests/unit/drafters/test_dflash.py checks this).

Parameter names are the checkpoint names vLLM loads (``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.*``,
``norm.weight``; vLLM prefixes ``model.`` and stacks q/k/v and gate/up): ``state_dict()`` is the export
(dflash_export.py). Initialisation (``reset_parameters``): every linear weight ~ N(0, 0.02^2) from the given
generator, every RMSNorm scale 1; there are no biases. RoPE: plain NeoX RoPE with the target's base theta (the
drafter's RoPE is its own; a Llama 3 target's RoPE scaling is not carried over).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from skyrl_mtp.drafters.eagle3 import RMSNorm, SwiGLU, init_drafter_weights, rotate
from skyrl_mtp.errors import ConfigError, problem

DEFAULT_BLOCK_SIZE = 8


def default_target_layer_ids(target_num_layers: int, num_layers: int) -> tuple[int, ...]:
    """The target layers (0-based: the output of layer L) a drafter of ``num_layers`` layers reads by default: the
    published DFlash drafters' choice (one id per drafter layer: ``n // 2`` for one layer, else evenly spaced over
    1..n-3, rounded) when it gives distinct ids in [0, n-1]; for the tiny targets where it does not, ids evenly
    spaced over [0, n-1] (as many as fit)."""
    n, m = target_num_layers, num_layers
    if m == 1:
        return (n // 2,)
    ids = tuple(int(round(1 + i * (n - 4) / (m - 1))) for i in range(m))
    if len(set(ids)) == m and ids[0] >= 0 and ids[-1] <= n - 1 and list(ids) == sorted(ids):
        return ids
    m = min(m, n)
    return tuple(sorted({int(round(i * (n - 1) / max(m - 1, 1))) for i in range(m)}))


@dataclass(frozen=True)
class DFlashConfig:
    """The drafter's shape (Qwen3 layers of the target's width), the target layers it reads, its block size
    (1 anchor + block_size - 1 mask slots; vLLM's num_speculative_tokens should be block_size - 1) and the
    token whose target embedding marks a slot to fill."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_position_embeddings: int
    target_num_layers: int
    target_layer_ids: tuple[int, ...]
    num_layers: int = 1
    block_size: int = DEFAULT_BLOCK_SIZE
    mask_token_id: int = 0

    def __post_init__(self) -> None:
        bad = []
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "max_position_embeddings", "target_num_layers", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                bad.append(problem(f"DFlashConfig.{name}", value, "an int >= 1"))
        if not bad and self.num_attention_heads % self.num_key_value_heads:
            bad.append(problem("DFlashConfig.num_key_value_heads", self.num_key_value_heads,
                               f"a divisor of num_attention_heads={self.num_attention_heads}"))
        if not bad and self.head_dim % 2:
            bad.append(problem("DFlashConfig.head_dim", self.head_dim, "an even int (RoPE rotates pairs)"))
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 2:
            bad.append(problem("DFlashConfig.block_size", b, "an int >= 2 (the anchor plus at least one mask slot)"))
        ids = tuple(self.target_layer_ids) if isinstance(self.target_layer_ids, (tuple, list)) else None
        n = self.target_num_layers
        if (ids is None or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
                or len(set(ids)) != len(ids) or min(ids) < 0 or (isinstance(n, int) and max(ids) > n - 1)):
            bad.append(problem("DFlashConfig.target_layer_ids", self.target_layer_ids,
                               f"distinct 0-based layer ids within [0, {n - 1 if isinstance(n, int) else 'n-1'}] "
                               "(id L = the target's hidden state after layer L; vLLM reads them in this order)"))
        else:
            object.__setattr__(self, "target_layer_ids", ids)
        m, v = self.mask_token_id, self.vocab_size
        if isinstance(m, bool) or not isinstance(m, int) or m < 0 or (isinstance(v, int) and m >= v):
            bad.append(problem("DFlashConfig.mask_token_id", m,
                               f"a token id in [0, {v}) (its row of the target's embedding marks the slots to fill)"))
        if not (isinstance(self.rms_norm_eps, float) and self.rms_norm_eps > 0):
            bad.append(problem("DFlashConfig.rms_norm_eps", self.rms_norm_eps, "a float > 0"))
        if not (isinstance(self.rope_theta, float) and self.rope_theta > 0):
            bad.append(problem("DFlashConfig.rope_theta", self.rope_theta, "a float > 0"))
        if bad:
            raise ConfigError(bad)

    @property
    def num_speculative_tokens(self) -> int:
        """The k vLLM should serve this drafter with: one draft per mask slot of a block."""
        return self.block_size - 1

    @classmethod
    def from_target(cls, hf_config: dict, target_layer_ids: tuple[int, ...] | None = None, num_layers: int = 1,
                    block_size: int = DEFAULT_BLOCK_SIZE, mask_token_id: int | None = None) -> DFlashConfig:
        """The drafter of a target whose config.json is ``hf_config``: its hidden size, MLP width, heads, norm
        epsilon, RoPE base, vocabulary and context; ``num_layers`` drafter layers reading ``target_layer_ids``
        (0-based) or default_target_layer_ids; ``mask_token_id`` defaults to the last row of the vocabulary
        (past a real tokenizer's ids in the padded vocabularies of the families served here)."""
        from skyrl_mtp.models.families.dense_common import rope_settings

        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in required if k not in hf_config]
        if missing:
            raise ConfigError([problem("target config.json", sorted(hf_config)[:8],
                                       f"a dict with {list(required)} (missing {missing})")])
        heads = int(hf_config["num_attention_heads"])
        theta, _ = rope_settings(hf_config, "DFlash target", llama3_scaling=True)
        n = int(hf_config["num_hidden_layers"])
        vocab = int(hf_config["vocab_size"])
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ConfigError([problem("DFlashConfig.num_layers", num_layers, "an int >= 1")])
        return cls(
            hidden_size=int(hf_config["hidden_size"]),
            intermediate_size=int(hf_config["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf_config.get("num_key_value_heads") or heads),
            head_dim=int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads),
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            vocab_size=vocab,
            max_position_embeddings=int(hf_config.get("max_position_embeddings", 2048)),
            target_num_layers=n,
            target_layer_ids=(tuple(target_layer_ids) if target_layer_ids is not None
                              else default_target_layer_ids(n, num_layers)),
            num_layers=num_layers,
            block_size=block_size,
            mask_token_id=vocab - 1 if mask_token_id is None else mask_token_id,
        )

    def inverse_frequencies(self) -> torch.Tensor:
        """RoPE's inverse frequencies, fp32, as vLLM's default RotaryEmbedding computes them."""
        d = self.head_dim
        return 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))


def rope_tables(cfg: DFlashConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, head_dim/2] at ``positions`` [B, T]: fp32 angles cast to ``dtype`` (vLLM's cache)."""
    freqs = positions.to(torch.float)[..., None] * cfg.inverse_frequencies().to(positions.device)
    return freqs.cos()[:, None].to(dtype), freqs.sin()[:, None].to(dtype)


class DFlashAttention(nn.Module):
    """Qwen3 attention (q/k/v, per-head q_norm / k_norm, RoPE, o_proj) whose keys are the context's plus the
    block's."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, heads, T, d] keys (k_norm, RoPE) and values of ``x`` [B, T, H], kv heads expanded to query heads."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        group = self.heads // self.kv_heads   # query head i reads kv head i // group
        return rotate(k, cos, sin).repeat_interleave(group, 1), v.repeat_interleave(group, 1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_k: torch.Tensor,
                context_v: torch.Tensor, context_mask: torch.Tensor | None, block_size: int) -> torch.Tensor:
        """x [B, N * block_size, H]: N blocks; each query sees the context keys ``context_mask`` [B, 1, N * bs, C]
        allows (all when None) and every key of its own block."""
        b, q_len, _ = x.shape
        n = q_len // block_size
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = rotate(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        scale = self.head_dim ** -0.5
        ctx = (q @ context_k.transpose(-1, -2)).float() * scale                  # [B, heads, N * bs, C]
        if context_mask is not None:
            ctx = ctx.masked_fill(~context_mask, float("-inf"))
        qb = q.view(b, self.heads, n, block_size, self.head_dim)
        kb = k.view(b, self.heads, n, block_size, self.head_dim)
        vb = v.view(b, self.heads, n, block_size, self.head_dim)
        own = (qb @ kb.transpose(-1, -2)).float() * scale                       # [B, heads, N, bs, bs]
        c = ctx.shape[-1]
        probs = torch.cat([ctx.view(b, self.heads, n, block_size, c), own], dim=-1).softmax(-1).to(v.dtype)
        out = probs[..., :c].reshape(b, self.heads, q_len, c) @ context_v
        out = out + (probs[..., c:] @ vb).reshape(b, self.heads, q_len, self.head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.heads * self.head_dim))


class DFlashLayer(nn.Module):
    """vLLM's DFlashQwen3DecoderLayer (checkpoint prefix ``layers.{i}.``)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)


class DFlashDrafter(nn.Module):
    """The drafter's layers; ``state_dict()`` holds exactly the tensors of vLLM's checkpoint (no lm_head, no
    embed_tokens: the target's are passed in, see the module docstring)."""

    def __init__(self, cfg: DFlashConfig, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.reset_parameters(generator)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_drafter_weights(self, generator)

    def context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(aux))`` [B, C, H]: vLLM's combine_hidden_states, then _project_context_kv's norm."""
        expected = len(self.cfg.target_layer_ids) * self.cfg.hidden_size
        if aux_hidden.shape[-1] != expected:
            raise ValueError(f"aux_hidden has last dimension {aux_hidden.shape[-1]}: expected {expected} (the target's "
                             f"hidden states at target_layer_ids={list(self.cfg.target_layer_ids)}, concatenated)")
        return self.hidden_norm(self.fc(aux_hidden))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values vLLM writes into its KV cache for the context rows at ``positions``."""
        cos, sin = rope_tables(self.cfg, positions, context.dtype)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                context_kv: list[tuple[torch.Tensor, torch.Tensor]], context_mask: torch.Tensor | None = None,
                block_size: int | None = None) -> torch.Tensor:
        """The query pass: [B, N * block_size, H] after the drafter's norm (the lm_head's input).

        block_embeds [B, N * bs, H]: N blocks of the TARGET's embeddings of (anchor, mask, ..., mask);
        block_positions [B, N * bs]; context_kv: ``context_kv()``'s per-layer keys/values of C context rows;
        context_mask [B, 1, N * bs, C] bool (None: every query sees every context row); block_size: bs (default:
        the whole query is one block)."""
        bs = block_embeds.shape[1] if block_size is None else block_size
        if block_embeds.shape[1] % bs:
            raise ValueError(f"{block_embeds.shape[1]} query rows are not whole blocks of {bs}")
        cos, sin = rope_tables(self.cfg, block_positions, block_embeds.dtype)
        hidden, residual = block_embeds, None
        for layer, (ck, cv) in zip(self.layers, context_kv, strict=True):
            residual = hidden if residual is None else hidden + residual
            attn = layer.self_attn(layer.input_layernorm(residual), cos, sin, ck, cv, context_mask, bs)
            residual = attn + residual
            hidden = layer.mlp(layer.post_attention_layernorm(residual))
        return self.norm(hidden + residual)


EmbedLike = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]


def _lookup(embed: EmbedLike) -> Callable[[torch.Tensor], torch.Tensor]:
    return embed if callable(embed) else (lambda ids: F.embedding(ids, embed))


def block_tokens(anchor_ids: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """[..., block_size]: each anchor followed by block_size - 1 mask tokens (vLLM's query block)."""
    masks = anchor_ids.new_full((*anchor_ids.shape, block_size - 1), mask_token_id)
    return torch.cat([anchor_ids[..., None], masks], dim=-1)


def propose(drafter: DFlashDrafter, aux_context: torch.Tensor, context_positions: torch.Tensor,
            anchor_ids: torch.Tensor, anchor_positions: torch.Tensor, embed: EmbedLike,
            num_speculative_tokens: int) -> torch.Tensor:
    """vLLM's one proposal per row: [B, 1 + k, H] outputs of the block (anchor, k masks) at positions
    anchor_position + 0..k over the context rows ``aux_context`` [B, C, n_ids * H] (the target's states at
    ``context_positions`` [B, C], all verified before the anchor); slot i >= 1 drafts the token at
    anchor_position + i. anchor_ids, anchor_positions: [B]."""
    cfg = drafter.cfg
    kv = drafter.context_kv(drafter.context(aux_context), context_positions)
    tokens = block_tokens(anchor_ids, num_speculative_tokens + 1, cfg.mask_token_id)
    positions = anchor_positions[:, None] + torch.arange(num_speculative_tokens + 1, device=anchor_ids.device)
    return drafter(_lookup(embed)(tokens), positions, kv)


def block_hidden(drafter: DFlashDrafter, aux_hidden: torch.Tensor, input_ids: torch.Tensor, embed: EmbedLike,
                 anchors: torch.Tensor, *, block_size: int | None = None, positions: torch.Tensor | None = None,
                 segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The training form: [B, N, block_size, H] outputs for N blocks per row, block n anchored at sequence index
    ``anchors[:, n]`` (>= 1; the anchor token is ids[a], the context the target's states at indices < a in a's
    segment), slot j >= 1 predicting ids[a + j] (see block_labels). Equal, block by block, to ``propose`` on the
    sequence cut at a (the module docstring says why).

    aux_hidden [B, T, n_ids * H]: the target's states at target_layer_ids (detached by the caller);
    input_ids [B, T]; embed: the target's embedding weight [V, H] or a function of ids; anchors [B, N] long;
    block_size: default cfg.block_size; positions [B, T]: default 0..T-1 (block positions continue the anchor's);
    segment_ids [B, T]: packed sequences / padding (context rows of other segments are invisible).
    Cost: the context scores are [B, heads, N * block_size, T] (the block part is block-diagonal, [.., N, bs, bs]):
    on long sequences train on a sampled subset of anchors."""
    cfg = drafter.cfg
    bs = cfg.block_size if block_size is None else block_size
    b, t = input_ids.shape
    if anchors.dim() != 2 or anchors.shape[0] != b:
        raise ValueError(f"anchors has shape {tuple(anchors.shape)}: expected [{b}, N]")
    if anchors.numel() and (int(anchors.min()) < 1 or int(anchors.max()) > t - 1):
        raise ValueError(f"anchors must lie in [1, {t - 1}] (an anchor needs at least one context row before it)")
    if positions is None:
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
    n = anchors.shape[1]
    kv = drafter.context_kv(drafter.context(aux_hidden), positions)
    tokens = block_tokens(input_ids.gather(1, anchors), bs, cfg.mask_token_id)                   # [B, N, bs]
    offsets = torch.arange(bs, device=input_ids.device)
    block_pos = (positions.gather(1, anchors)[..., None] + offsets).reshape(b, n * bs)
    visible = torch.arange(t, device=input_ids.device) < anchors[..., None]                       # [B, N, T]
    if segment_ids is not None:
        visible = visible & (segment_ids[:, None, :] == segment_ids.gather(1, anchors)[..., None])
    mask = visible[:, None, :, None, :].expand(b, 1, n, bs, t).reshape(b, 1, n * bs, t)
    out = drafter(_lookup(embed)(tokens.reshape(b, n * bs)), block_pos, kv, mask, bs)
    return out.view(b, n, bs, -1)


def block_labels(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 segment_ids: torch.Tensor | None = None, ignore_index: int = -100) -> torch.Tensor:
    """[B, N, block_size - 1]: the token each mask slot of block_hidden predicts (ids[a + j], j = 1..bs-1), or
    ``ignore_index`` past the sequence or across a segment boundary."""
    b, t = input_ids.shape
    idx = anchors[..., None] + torch.arange(1, block_size, device=input_ids.device)               # [B, N, bs-1]
    inside = idx < t
    clamped = idx.clamp(max=t - 1)
    labels = input_ids.gather(1, clamped.reshape(b, -1)).view_as(idx)
    if segment_ids is not None:
        same = segment_ids.gather(1, clamped.reshape(b, -1)).view_as(idx) == segment_ids.gather(1, anchors)[..., None]
        inside = inside & same
    return labels.masked_fill(~inside, ignore_index)
