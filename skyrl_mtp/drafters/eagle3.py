"""The EAGLE-3 drafter: one decoder layer fed with three of the target's hidden states, computing exactly what
vLLM 0.32 computes for ``speculative_config={"method": "eagle3"}`` with its Llama drafter
(vllm/model_executor/models/llama_eagle3.py, driven by v1/spec_decode/llm_base_proposer.py).

What vLLM does, step by step (so the trainer can replay it):

- The target emits auxiliary hidden states at ``aux_layer_ids`` (EagleModelMixin._maybe_add_hidden_state in
  vllm/model_executor/models/interfaces.py): id 0 is the token embedding, id L >= 1 the residual stream after
  decoder layer L-1 (``hidden_states + residual``, before any final norm). vLLM keeps them in INCREASING id
  order (``_set_aux_hidden_state_layers`` sorts and drops duplicates) and concatenates them on the last
  dimension: ``aux [.., 3H]``. In transformers, ``output_hidden_states[L]`` is the same tensor for L < n
  (n = the target's layer count); ``output_hidden_states[n]`` is taken AFTER the final norm, aux id n before it.
- First pass over the tokens the target just verified, at sequence index t: ``h = fc(aux[t])`` (no norm before
  fc), input token = the NEXT token ``ids[t+1]`` (the proposer shifts the ids by one; the newest, just sampled
  token fills the last slot), RoPE position = t (positions are NOT shifted). The drafter's KV cache at index t
  comes from this pass.
- The layer (``midlayer``, vLLM's ``layers.0``): ``x = cat([input_layernorm(embed), hidden_norm(h)])`` (embedding
  FIRST, 2H wide, into q/k/v), residual = h (un-normed); causal self-attention; ``o_proj``; residual add +
  ``post_attention_layernorm``; SwiGLU MLP; residual add; the drafter's own ``norm``.
  Two outputs: ``hidden`` (after ``norm``) goes to the lm_head; ``next_hidden`` (the residual stream before
  ``norm``) is fed back as ``h`` of the next draft.
- Draft j+1 (j >= 1) at the same request: input token = draft j, ``h`` = ``next_hidden`` of draft j, RoPE position
  t+j; it attends to the first-pass keys at indices <= t and to the keys of drafts 2..j+1 at their positions
  (the test-time-training pattern: context keys plus a diagonal per unroll step). ``Eagle3Cache`` holds both.
- Draft tokens are the argmax of the TARGET's lm_head on ``hidden``; the token embedding is the TARGET's
  ``embed_tokens``: a checkpoint without ``lm_head`` / ``embed_tokens`` shares the target's tensors
  (SpecDecodeBaseProposer._maybe_share_embeddings / _maybe_share_lm_head). So the module has neither; the caller
  passes the target's embedding rows in and applies the target's lm_head weight to ``hidden``.

Parameter names are the checkpoint names vLLM loads (``fc.weight``, ``midlayer.*``, ``norm.weight``): the
module's ``state_dict()`` is the export (eagle3_export.py).

Initialisation (``reset_parameters``): every linear weight ~ N(0, 0.02^2) from the given generator, every RMSNorm
scale 1; there are no biases.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from skyrl_mtp.errors import ConfigError, problem

INIT_STD = 0.02
# the hidden states of the target the drafter reads (EAGLE-3: low, middle and high layers)
NUM_AUX = 3


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The captured layers of a target of ``num_layers`` decoder layers, in vLLM's numbering (0 = embedding,
    L = after layer L-1): vLLM's own default ``(2, n//2, n-3)`` (SupportsEagle3.
    get_eagle3_default_aux_hidden_state_layers) when those are three distinct ids in [0, n-1]; for the smaller
    (tiny) models, where vLLM's default collapses to fewer ids (it drops duplicates, and the drafter's fc would
    then get fewer than 3H inputs), ``(1, ceil(n/2), n-1)`` for n = 4..6 and ``(0, 1, 2)`` for n = 2, 3. Only
    n = 2 uses id n (after the last layer, before the final norm)."""
    n = num_layers
    for ids in ((2, n // 2, n - 3), (1, (n + 1) // 2, n - 1), (0, 1, 2)):
        if 0 <= ids[0] < ids[1] < ids[2] <= min(n, max(n - 1, 2)):
            return ids
    raise ConfigError([problem("num_hidden_layers", n, "an int >= 2 (EAGLE-3 reads three distinct hidden states "
                                                       "of the target, ids 0..n)")])


@dataclass(frozen=True)
class Eagle3Config:
    """The drafter's shape, its RoPE (the target's: the drafter runs at the target's positions) and the target's
    layers it reads. ``rope_scaling_factor``: Llama 3's RoPE scaling factor (the other Llama 3 settings are the
    fixed ones of dense_common.LLAMA3_ROPE_FIXED), None for plain RoPE."""

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
    aux_layer_ids: tuple[int, int, int]
    rope_scaling_factor: float | None = None

    def __post_init__(self) -> None:
        bad = []
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "max_position_embeddings", "target_num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                bad.append(problem(f"Eagle3Config.{name}", value, "an int >= 1"))
        if not bad and self.num_attention_heads % self.num_key_value_heads:
            bad.append(problem("Eagle3Config.num_key_value_heads", self.num_key_value_heads,
                               f"a divisor of num_attention_heads={self.num_attention_heads}"))
        ids = tuple(self.aux_layer_ids) if isinstance(self.aux_layer_ids, (tuple, list)) else self.aux_layer_ids
        n = self.target_num_layers
        if (not isinstance(ids, tuple) or len(ids) != NUM_AUX
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
                or list(ids) != sorted(set(ids)) or ids[0] < 0 or (isinstance(n, int) and ids[-1] > n)):
            bad.append(problem("Eagle3Config.aux_layer_ids", self.aux_layer_ids,
                               f"three distinct layer ids in increasing order within [0, {n}] (vLLM's numbering: 0 "
                               "= the embedding, L = after layer L-1; vLLM concatenates them in increasing order)"))
        else:
            object.__setattr__(self, "aux_layer_ids", ids)
        if not (isinstance(self.rms_norm_eps, float) and self.rms_norm_eps > 0):
            bad.append(problem("Eagle3Config.rms_norm_eps", self.rms_norm_eps, "a float > 0"))
        if not (isinstance(self.rope_theta, float) and self.rope_theta > 0):
            bad.append(problem("Eagle3Config.rope_theta", self.rope_theta, "a float > 0"))
        if self.rope_scaling_factor is not None and not (isinstance(self.rope_scaling_factor, float)
                                                         and self.rope_scaling_factor > 0):
            bad.append(problem("Eagle3Config.rope_scaling_factor", self.rope_scaling_factor,
                               "None or a float > 0 (Llama 3 RoPE scaling)"))
        if bad:
            raise ConfigError(bad)

    @classmethod
    def from_target(cls, hf_config: dict, aux_layer_ids: tuple[int, int, int] | None = None) -> Eagle3Config:
        """The drafter of a target whose config.json is ``hf_config``: its hidden size, MLP width, heads, norm
        epsilon, RoPE, vocabulary and context; ``aux_layer_ids`` (vLLM's numbering) or default_aux_layer_ids."""
        from skyrl_mtp.models.families.dense_common import rope_settings

        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in required if k not in hf_config]
        if missing:
            raise ConfigError([problem("target config.json", sorted(hf_config)[:8],
                                       f"a dict with {list(required)} (missing {missing})")])
        heads = int(hf_config["num_attention_heads"])
        theta, factor = rope_settings(hf_config, "EAGLE-3 target", llama3_scaling=True)
        n = int(hf_config["num_hidden_layers"])
        return cls(
            hidden_size=int(hf_config["hidden_size"]),
            intermediate_size=int(hf_config["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf_config.get("num_key_value_heads") or heads),
            head_dim=int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads),
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling_factor=factor,
            vocab_size=int(hf_config["vocab_size"]),
            max_position_embeddings=int(hf_config.get("max_position_embeddings", 2048)),
            target_num_layers=n,
            aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(n),
        )

    def inverse_frequencies(self) -> torch.Tensor:
        """RoPE's inverse frequencies, fp32, as vLLM's RotaryEmbedding / Llama3RotaryEmbedding compute them."""
        from skyrl_mtp.models.families.dense_common import LLAMA3_ROPE_FIXED

        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        if self.rope_scaling_factor is None:
            return inv
        low, high = LLAMA3_ROPE_FIXED["low_freq_factor"], LLAMA3_ROPE_FIXED["high_freq_factor"]
        orig = LLAMA3_ROPE_FIXED["original_max_position_embeddings"]
        wave_len = 2 * math.pi / inv
        smooth = (orig / wave_len - low) / (high - low)
        scaled = inv / self.rope_scaling_factor
        return torch.where(wave_len < orig / high, inv,
                           torch.where(wave_len > orig / low, scaled, (1 - smooth) * scaled + smooth * inv))


class RMSNorm(nn.Module):
    """vLLM's RMSNorm (vllm/ir/ops/layernorm.py rms_norm): normalise in fp32, then scale."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.to(self.weight.dtype) * self.weight).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style RoPE (vLLM's ``is_neox_style=True`` for Llama): the two halves of each head rotate together."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass
class Eagle3Cache:
    """The keys a test-time-training unroll attends to: the first pass's (context, causal, same segment) and one
    per later unroll step (the diagonal: query t of step j sees step i's key at t, 1 <= i <= j). Heads already
    expanded to the query heads, RoPE applied: [B, heads, T, head_dim]."""

    context_k: torch.Tensor | None = None
    context_v: torch.Tensor | None = None
    context_mask: torch.Tensor | None = None       # [B, 1, T, T] bool: key s visible to query t
    diagonal_k: list[torch.Tensor] = field(default_factory=list)
    diagonal_v: list[torch.Tensor] = field(default_factory=list)


def causal_mask(batch: int, length: int, segment_ids: torch.Tensor | None, device) -> torch.Tensor:
    """[B, 1, T, T]: key s <= query t, in the same segment (packed sequences, padding) when ``segment_ids``."""
    mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    mask = mask.expand(batch, 1, length, length)
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return mask


class Eagle3Attention(nn.Module):
    """q/k/v over the 2H input (embedding, hidden), grouped-query attention, RoPE, o_proj back to H."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache: Eagle3Cache | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        group = self.heads // self.kv_heads   # query head i reads kv head i // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scale = self.head_dim ** -0.5
        if cache is None or cache.context_k is None:
            scores = (q @ k.transpose(-1, -2)).float() * scale
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
            out = probs @ v
            if cache is not None:
                cache.context_k, cache.context_v, cache.context_mask = k, v, mask
        else:
            ctx = (q @ cache.context_k.transpose(-1, -2)).float() * scale
            ctx = ctx.masked_fill(~cache.context_mask, float("-inf"))
            diag_k = [*cache.diagonal_k, k]
            diag_v = [*cache.diagonal_v, v]
            diag = torch.stack([(q * dk).sum(-1) for dk in diag_k], dim=-1).float() * scale   # [B, heads, T, j]
            probs = torch.cat([ctx, diag], dim=-1).softmax(-1).to(v.dtype)
            out = probs[..., :t] @ cache.context_v
            for i, dv in enumerate(diag_v):
                out = out + probs[..., t + i, None] * dv
            cache.diagonal_k.append(k)
            cache.diagonal_v.append(v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """The drafters' MLP (vLLM's LlamaMLP / Qwen3MLP): ``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@torch.no_grad()
def init_drafter_weights(model: nn.Module, generator: torch.Generator | None = None) -> None:
    """Every linear weight ~ N(0, INIT_STD^2) from ``generator``, every RMSNorm scale 1 (the drafters have no biases)."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, INIT_STD, generator=generator)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)


class Eagle3Midlayer(nn.Module):
    """vLLM's llama_eagle3.LlamaDecoderLayer at layer 0 (checkpoint prefix ``midlayer.``)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)


class Eagle3Output(NamedTuple):
    hidden: torch.Tensor        # [B, T, H] after the drafter's norm: the lm_head's input
    next_hidden: torch.Tensor   # [B, T, H] the residual stream before the norm: ``hidden`` of the next draft


class Eagle3Drafter(nn.Module):
    """One EAGLE-3 layer; ``state_dict()`` holds exactly the tensors of vLLM's checkpoint (no lm_head, no
    embed_tokens: the target's are passed in, see the module docstring)."""

    def __init__(self, cfg: Eagle3Config, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(NUM_AUX * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Midlayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.reset_parameters(generator)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_drafter_weights(self, generator)

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """vLLM's ``combine_hidden_states``: fc over the three captured states, concatenated in id order."""
        return self.fc(aux_hidden)

    def forward(self, input_embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: Eagle3Cache | None = None, segment_ids: torch.Tensor | None = None) -> Eagle3Output:
        """One drafter pass over [B, T] positions.

        input_embeds [B, T, H]: the TARGET's embedding of the token AFTER each position's (first pass: ids[t+1];
        unroll step j: the token drafted, or for training the true token ids[t+1+j]).
        hidden: [B, T, 3H] the captured aux states (first pass; fc applied here) or [B, T, H] the previous
        pass's ``next_hidden`` (unroll steps).
        positions [B, T]: RoPE positions (first pass: t; unroll step j: t + j).
        cache: None for one causal pass; an ``Eagle3Cache`` to unroll: the first call on an empty cache is the
        first pass (causal; its keys are stored), each later call an unroll step (context keys at indices <= t
        plus the diagonal keys of the earlier steps and its own).
        segment_ids [B, T] (optional, first pass): attention stays within equal ids (packing, padding).
        """
        h = self.cfg.hidden_size
        if hidden.shape[-1] == NUM_AUX * h:
            hidden = self.combine(hidden)
        elif hidden.shape[-1] != h:
            raise ValueError(f"hidden has last dimension {hidden.shape[-1]}: expected {NUM_AUX * h} (the captured "
                             f"aux states) or {h} (the previous pass's next_hidden)")
        b, t, _ = input_embeds.shape
        # fp32 angles whatever the weights' dtype, cast like vLLM's cos/sin cache (it is built in fp32)
        inv_freq = self.cfg.inverse_frequencies().to(positions.device)
        freqs = positions.to(torch.float)[..., None] * inv_freq   # [B, T, head_dim / 2]
        cos, sin = freqs.cos()[:, None].to(hidden.dtype), freqs.sin()[:, None].to(hidden.dtype)
        mask = causal_mask(b, t, segment_ids, hidden.device) if cache is None or cache.context_k is None else None
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(input_embeds), layer.hidden_norm(hidden)], dim=-1)
        residual = hidden + layer.self_attn(x, cos, sin, mask, cache)
        residual = residual + layer.mlp(layer.post_attention_layernorm(residual))
        return Eagle3Output(hidden=self.norm(residual), next_hidden=residual)


def shift_ids(input_ids: torch.Tensor, by: int, fill: int = 0) -> torch.Tensor:
    """ids[t + by] at index t; ``fill`` past the end (those indices have no target and are masked by the caller)."""
    pad = input_ids.new_full((input_ids.shape[0], by), fill)
    return torch.cat([input_ids[:, by:], pad], dim=1)


def unroll(drafter: Eagle3Drafter, aux_hidden: torch.Tensor, input_ids: torch.Tensor,
           embed: torch.Tensor | Callable[[torch.Tensor], torch.Tensor], steps: int, *,
           positions: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None,
           greedy_lm_head: torch.Tensor | None = None) -> list[Eagle3Output]:
    """``steps`` drafter passes over whole sequences (the test-time-training unroll), pass j's output at index t
    being the draft of the token at t + 2 + j that vLLM proposes from index t (t = the last position whose target
    hidden state it has; ids[t+1] is the token just sampled).

    aux_hidden [B, T, 3H]: the target's captured states (detached by the caller); input_ids [B, T]; embed: the
    target's embedding, as its weight [V, H] or as a function of ids [B, T] -> [B, T, H] (a vocab-parallel one);
    positions: default 0..T-1 per row. Pass 0 reads ids[t+1]; pass j >= 1 reads ids[t+1+j] (teacher forcing, for
    training: a draft after a rejected one never counts, so conditioning on the true tokens is exact) or, with
    ``greedy_lm_head`` (the target's lm_head weight [V, H]), the argmax draft of pass j-1 (what vLLM feeds itself).
    Indices whose token t+1+j lies past the sequence (or across a segment boundary) read a filler token and must be
    masked by the caller."""
    lookup = embed if callable(embed) else (lambda ids: F.embedding(ids, embed))
    b, t = input_ids.shape
    if positions is None:
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
    cache = Eagle3Cache()
    out = drafter(lookup(shift_ids(input_ids, 1)), aux_hidden, positions, cache, segment_ids)
    outs = [out]
    for j in range(1, steps):
        if greedy_lm_head is None:
            tokens = shift_ids(input_ids, 1 + j)
        else:
            tokens = F.linear(out.hidden, greedy_lm_head).argmax(-1)
        out = drafter(lookup(tokens), out.next_hidden, positions + j, cache)
        outs.append(out)
    return outs
