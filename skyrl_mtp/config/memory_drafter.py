"""An external drafter's part of the GPU memory plan (trainer.drafter.kind=eagle3 or dflash), per GPU.

Why a module of its own: a drafter trained beside the policy is not part of the Megatron model, so none of
memory_formulas' terms count it, and it is laid out unlike the policy: it lives beside the model on every policy rank
in fp32 whatever the policy's dtype, whole on every tensor-parallel rank, with a torch AdamW of its own that data
parallelism does not shard (policy/drafter_training.py ExternalDrafterTraining: ``TorchSideOptimizer(...,
tp_group=None)``), and its loss runs after the policy's backward on the target's captured hidden states.

EAGLE-3 (drafters/eagle3.py, mtp/eagle3_loss.py): one decoder layer re-run over every position of a micro-batch
once per trained depth, its attention materialising [rows, heads, S, S] scores in fp32 (Eagle3Attention); the
engines serve it with one attention layer of KV cache.

DFlash (drafters/dflash.py, mtp/dflash_loss.py): ``num_layers`` decoder layers; its training form (block_hidden)
runs one context pass over the whole sequence (fc, hidden_norm, each layer's context keys and values) and one query
pass over ``anchors`` blocks of block_size slots, each query scoring every context position in fp32 ([rows, heads,
anchors x block_size, S]: small beside EAGLE-3's [S, S]); the engines keep K/V of every drafter layer.

The shapes are the target's (Eagle3Config / DFlashConfig.from_target: hidden size, MLP width, heads, kv heads, head
dim), read here off the target's ModelShape; a DFlash drafter's layers, target layer ids, block and anchors come
from trainer.drafter (dflash_settings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EAGLE3 = "eagle3"
DFLASH = "dflash"
# fp32 weights, their fp32 grads, AdamW's exp_avg and exp_avg_sq (fp32 params: no separate master copy); the
# fused AdamW it steps with on GPUs (policy/megatron/optimizers.py build_optimizer) allocates no temporaries
DRAFTER_STATE_BYTES = 16
DRAFTER_WEIGHT_BYTES = 4
# drafters/eagle3.py NUM_AUX: the target's hidden states it reads (captured, concatenated into fc's input)
NUM_AUX = 3


def external_drafter_kind(cfg: Any) -> str | None:
    """The kind of drafter trained beside the policy: trainer.drafter.kind other than mtp while the engines speculate
    (trainer/run_plan.py external_drafter, the rule the policy workers are configured by)."""
    kind = str(cfg.trainer.drafter.kind)
    return kind if kind != "mtp" and bool(cfg.trainer.mtp.enabled) else None


def eagle3_params(shape: Any) -> tuple[int, int]:
    """(parameters vLLM's tensor parallelism shards, parameters every rank holds whole) of the drafter
    (drafters/eagle3.py Eagle3Drafter): q_proj [a d, 2H], k_proj and v_proj [g d, 2H], o_proj [H, a d], the SwiGLU
    MLP's gate / up [F, H] and down [H, F] (vLLM's llama_eagle3.py: QKVParallelLinear, row / column parallel);
    fc [H, 3H] (a ReplicatedLinear there) and four RMSNorms of H (input_layernorm, hidden_norm,
    post_attention_layernorm, norm). No embedding or LM head: it shares the target's."""
    h, a, g, d, f = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate
    return 2 * h * (a + 2 * g) * d + a * d * h + 3 * h * f, NUM_AUX * h * h + 4 * h


def eagle3_param_count(shape: Any) -> int:
    return sum(eagle3_params(shape))


def eagle3_pass_elements(shape: Any, *, first: bool) -> int:
    """fp32 elements per token one drafter pass (drafters/eagle3.py Eagle3Drafter.forward) keeps for backward, its
    attention scores aside: the norms' normalised inputs (input_layernorm's of the embedding, hidden_norm's,
    post_attention_layernorm's, norm's: 4H), the residual stream after attention and after the MLP, the
    post-attention norm's output and the output ``hidden`` (4H), q/k/v's 2H input (the concatenation), q and the
    k, v repeated to every query head, the attention's output (4 a d), the MLP's gate, silu(gate), up and their
    product (4F); the first pass also fc's output (H; later passes read the previous pass's residual stream). Left
    out: RoPE's cos / sin and the norms' rsqrt (below H per token in all), and the pass's input embedding (H in
    fp32, read by no backward, freed with its pass). Checked against what autograd keeps on a tiny drafter
    (tests/unit/cluster/test_memory_drafter.py)."""
    h, a, d, f = shape.hidden, shape.heads, shape.head_dim, shape.intermediate
    return 8 * h + 2 * h + 4 * a * d + 4 * f + (h if first else 0)


def eagle3_attention_bytes(shape: Any, *, rows: int, seq: int, depths: int) -> int:
    """The drafter's attention over ``depths`` unroll passes (drafters/eagle3.py Eagle3Attention, fp32, every head on
    every TP rank): each pass keeps its softmax's fp32 output [rows, heads, S, S] (a later pass's also has a column
    per earlier pass: left out) for backward; the last pass's forward holds two more at once (the scaled and the
    masked scores beside the softmax's output), the backward two as well (the fp32 gradient of the probabilities and
    the one the softmax's backward returns); and the causal mask [rows, 1, S, S] bool (kept in Eagle3Cache) with
    its negation, which every masked_fill makes."""
    scores = rows * shape.heads * seq * seq
    return (depths + 2) * scores * 4 + 2 * rows * seq * seq


def eagle3_draft_loss_parts(shape: Any, *, rows: int, seq: int, depths: int, draft_tokens: int, chunk: int, tp: int,
                            act_bytes: int) -> dict[str, int]:
    """One micro-batch's EAGLE-3 draft loss after the policy's backward, by part (bytes):
    - captured states: the three [S, B, H] layer inputs in the model dtype (mtp/layer_capture.py), kept from the
      policy's forward until the loss takes them;
    - drafter activations: fc's input, concatenated in the model dtype and cast to fp32 (mtp/eagle3_loss.py
      concat_aux, ``aux.to(dtype)``: 3H each), and every pass's saved activations over rows x S tokens
      (eagle3_pass_elements, fp32);
    - drafter attention: eagle3_attention_bytes;
    - draft loss: the MTP head's chunked loss through the target's output layer (memory_formulas.draft_loss_bytes,
      replay aside): one depth's gathered teacher rows [draft tokens, vocab / TP] and one chunk's fp32 logits at a
      time, plus each depth's student rows in the model dtype and the gradient the chunked loss keeps of them."""
    from skyrl_mtp.config.memory_formulas import DRAFT_CHUNK_BYTES_PER_LOGIT

    h, tokens, v = shape.hidden, rows * seq, shape.vocab // tp
    passes = eagle3_pass_elements(shape, first=True) + (depths - 1) * eagle3_pass_elements(shape, first=False)
    return {
        "captured states": NUM_AUX * tokens * h * act_bytes,
        "drafter activations": NUM_AUX * tokens * h * (act_bytes + 4) + tokens * passes * 4,
        "drafter attention": eagle3_attention_bytes(shape, rows=rows, seq=seq, depths=depths),
        "draft loss": (draft_tokens * v * act_bytes + min(chunk, draft_tokens) * v * DRAFT_CHUNK_BYTES_PER_LOGIT
                       + depths * draft_tokens * h * act_bytes * 2),
    }


def eagle3_engine_weight_bytes(shape: Any, *, tp: int, engine_bytes: int) -> int:
    """The drafter's weights on one GPU of an engine of TP ``tp``, in the engine's dtype (vLLM loads the export,
    drafters/eagle3_export.py, into llama_eagle3.py's layers)."""
    sharded, replicated = eagle3_params(shape)
    return (sharded // tp + replicated) * engine_bytes


def eagle3_engine_activation_bytes(shape: Any, *, batched: int, engine_bytes: int) -> int:
    """What an engine step holds for the drafter beyond one layer's activations: the target's three aux hidden
    states of every scheduled token, kept through its forward, and their concatenation for the drafter's fc
    (v1/worker/gpu_model_runner.py: ``torch.cat([h[...] for h in aux_hidden_states], dim=-1)``)."""
    return 2 * NUM_AUX * batched * shape.hidden * engine_bytes


# ---------------------------------------------------------------------------------------------- DFlash

@dataclass(frozen=True)
class DFlashSettings:
    """What sizes a DFlash drafter and its loss beyond the target's shape: the values trainer/run_plan.py hands the
    policy workers (drafter_num_layers, drafter_layer_ids, drafter_block_size, drafter_anchors)."""

    layers: int     # decoder layers (trainer.drafter.num_layers); the engines keep K/V of each
    n_ids: int      # target layers it reads: fc's input is n_ids x H
    block: int      # slots of a block: the anchor and block - 1 mask slots
    anchors: int    # blocks a row trains at most (trainer.drafter.anchors)


def dflash_settings(cfg: Any, shape: Any) -> DFlashSettings:
    """trainer.drafter's DFlash keys, defaults resolved as the workers resolve them: the layer ids of
    drafters/dflash.py default_target_layer_ids (one per drafter layer), block_size k + 1 (run_plan.py)."""
    from skyrl_mtp.config.mtp_knob import max_speculative_tokens
    from skyrl_mtp.drafters.dflash import default_target_layer_ids

    d = cfg.trainer.drafter
    layers = int(d.num_layers)
    ids = list(d.layer_ids) if d.layer_ids else default_target_layer_ids(shape.layers, layers)
    block = int(d.block_size) if d.block_size is not None else max_speculative_tokens(cfg) + 1
    return DFlashSettings(layers=layers, n_ids=len(ids), block=block, anchors=int(d.anchors))


def dflash_params(shape: Any, s: DFlashSettings) -> tuple[int, int]:
    """(parameters vLLM's tensor parallelism shards, parameters every rank holds whole) of the drafter
    (drafters/dflash.py DFlashDrafter): per layer q_proj [a d, H], k_proj and v_proj [g d, H], o_proj [H, a d] and
    the SwiGLU MLP's gate / up [F, H] and down [H, F] (vLLM's qwen3_dflash.py: QKVParallelLinear, RowParallelLinear,
    Qwen3MLP); fc [H, n_ids H] (a ReplicatedLinear there), per layer q_norm / k_norm of d and input_layernorm /
    post_attention_layernorm of H, hidden_norm and norm of H. No embedding or LM head: it shares the target's."""
    h, a, g, d, f = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate
    sharded = s.layers * (h * (a + 2 * g) * d + a * d * h + 3 * h * f)
    return sharded, s.n_ids * h * h + s.layers * (2 * h + 2 * d) + 2 * h


def dflash_param_count(shape: Any, s: DFlashSettings) -> int:
    return sum(dflash_params(shape, s))


def dflash_context_elements(shape: Any, s: DFlashSettings) -> int:
    """fp32 elements per sequence position the context pass (DFlashDrafter.context, context_kv) keeps for backward:
    fc's output (hidden_norm's input), hidden_norm's normalised input and its output c (3H; c feeds every layer's
    k_proj / v_proj); per layer k_norm's input and normalised input (2 g d) and the keys and values repeated to
    every query head (2 a d), which the query pass's two matmuls keep. RoPE and repeat_interleave keep nothing of
    that size."""
    h, a, g, d = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim
    return 3 * h + s.layers * (2 * g * d + 2 * a * d)


def dflash_query_elements(shape: Any, s: DFlashSettings) -> int:
    """fp32 elements per block slot the query pass (DFlashDrafter.forward) keeps for backward, per layer: the input
    norm's input and normalised input (layer 0: the normalised only, its input is the detached embedding), its
    output (q/k/v's input), the post-attention norm's input, normalised input and output (6H, 5H in layer 0); q_norm's
    input and normalised input, the rotated q, the block's keys and values repeated to every head, the attention's
    output (6 a d); k_norm's input and normalised input (2 g d); the MLP's gate, silu(gate), up and product (4F);
    then the final norm's input, normalised input and output (3H, the output the loss reads). The scores:
    dflash_attention_bytes."""
    h, a, g, d, f = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate
    return s.layers * (6 * h + 6 * a * d + 2 * g * d + 4 * f) - h + 3 * h


def dflash_attention_bytes(shape: Any, s: DFlashSettings, *, rows: int, seq: int, blocks: int) -> int:
    """The query pass's scores (DFlashAttention.forward, fp32, every head on every TP rank), ``blocks`` blocks per
    row of s.block queries: each layer keeps its softmax's output [rows, heads, blocks x block, S + block] (the
    context's scores and the block's own) for backward; the last layer's forward holds two more at once (the masked
    context scores and their concatenation with the block's), the backward two as well (the gradient of the
    probabilities and the one the softmax's backward returns); and the context mask [rows, 1, blocks x block, S]
    bool (block_hidden) with the negation each layer's masked_fill makes and keeps."""
    queries = rows * blocks * s.block
    scores = queries * shape.heads * (seq + s.block)
    return (s.layers + 2) * scores * 4 + (s.layers + 1) * queries * seq


def dflash_draft_loss_parts(shape: Any, s: DFlashSettings, *, rows: int, seq: int, response: int, chunk: int,
                            tp: int, act_bytes: int) -> dict[str, int]:
    """One micro-batch's DFlash draft loss after the policy's backward, by part (bytes); ``response``: a row's
    trained tokens at most, which bound its anchors (mtp/dflash_loss.py choose_anchors: min(anchors, candidates)
    per row, every row padded to the longest):
    - captured states: the n_ids [S, B, H] layer inputs in the model dtype (mtp/layer_capture.py);
    - drafter context: fc's input, concatenated in the model dtype and cast to fp32 (mtp/eagle3_loss.py concat_aux,
      ``aux.to(dtype)``: n_ids H each), and the context pass over rows x S positions (dflash_context_elements);
    - drafter blocks: the query pass over rows x anchors x block slots (dflash_query_elements);
    - drafter attention: dflash_attention_bytes;
    - draft loss: per slot the chunked loss through the target's output layer (as memory_formulas.
      draft_loss_bytes, no replay): one slot's gathered teacher rows [rows x anchors, vocab / TP] and one chunk's
      fp32 logits at a time, plus every mask slot's student rows in the model dtype and the gradient the chunked
      loss keeps of them."""
    from skyrl_mtp.config.memory_formulas import DRAFT_CHUNK_BYTES_PER_LOGIT

    h, tokens, v = shape.hidden, rows * seq, shape.vocab // tp
    blocks = max(min(s.anchors, response), 1)
    trained = rows * blocks
    return {
        "captured states": s.n_ids * tokens * h * act_bytes,
        "drafter context": s.n_ids * tokens * h * (act_bytes + 4) + tokens * dflash_context_elements(shape, s) * 4,
        "drafter blocks": trained * s.block * dflash_query_elements(shape, s) * 4,
        "drafter attention": dflash_attention_bytes(shape, s, rows=rows, seq=seq, blocks=blocks),
        "draft loss": (trained * v * act_bytes + min(chunk, trained) * v * DRAFT_CHUNK_BYTES_PER_LOGIT
                       + (s.block - 1) * trained * h * act_bytes * 2),
    }


def dflash_engine_weight_bytes(shape: Any, s: DFlashSettings, *, tp: int, engine_bytes: int) -> int:
    """The drafter's weights on one GPU of an engine of TP ``tp``, in the engine's dtype (vLLM loads the export,
    drafters/dflash_export.py, into qwen3_dflash.py's layers), and what DFlashQwen3Model._build_context_kv_buffers
    copies of them for its one-GEMM context K/V (``torch.cat`` of every layer's k/v rows of qkv_proj: 2 x kv heads
    on this rank x d x H per layer; ``torch.stack`` of the k_norm weights), and the mask_embedding parameter (H)."""
    h, d = shape.hidden, shape.head_dim
    sharded, replicated = dflash_params(shape, s)
    fused = s.layers * (2 * max(shape.kv_heads // tp, 1) * d * h + d)
    return (sharded // tp + replicated + fused + h) * engine_bytes


def dflash_engine_activation_bytes(shape: Any, s: DFlashSettings, *, tp: int, batched: int, seqs: int, k: int,
                                   engine_bytes: int) -> int:
    """What an engine step holds for the drafter beyond one layer's activations, over every scheduled token: the
    target's n_ids aux hidden states and their concatenation (gpu_model_runner.py), fc's output and its hidden_norm
    (qwen3_dflash.py _project_context_kv), and the context K/V of every drafter layer twice at once (the fused
    GEMM's output and the layer-major ``permute(...).contiguous()`` copy of it); and the draft logits of every
    running sequence's k mask slots at once (parallel drafting: v1/spec_decode/llm_base_proposer.py
    _sample_draft_tokens over the target's whole vocabulary)."""
    kv = s.layers * max(shape.kv_heads // tp, 1) * shape.head_dim
    context = batched * (2 * s.n_ids * shape.hidden + 2 * shape.hidden + 4 * kv)
    return (context + seqs * k * shape.vocab) * engine_bytes


# ---------------------------------------------------------------------------------------------- either kind

def drafter_param_count(shape: Any, cfg: Any) -> int:
    """Parameters of the run's external drafter (external_drafter_kind)."""
    if external_drafter_kind(cfg) == DFLASH:
        return dflash_param_count(shape, dflash_settings(cfg, shape))
    return eagle3_param_count(shape)


def drafter_draft_loss_parts(shape: Any, cfg: Any, *, rows: int, seq: int, draft_tokens: int, chunk: int, tp: int,
                             act_bytes: int) -> dict[str, int]:
    """The external drafter's draft loss by part; ``draft_tokens``: the micro-batch's trained tokens at most."""
    if external_drafter_kind(cfg) == DFLASH:
        return dflash_draft_loss_parts(shape, dflash_settings(cfg, shape), rows=rows, seq=seq,
                                       response=draft_tokens // rows, chunk=chunk, tp=tp, act_bytes=act_bytes)
    from skyrl_mtp.config.mtp_knob import train_depths

    return eagle3_draft_loss_parts(shape, rows=rows, seq=seq, depths=train_depths(cfg), draft_tokens=draft_tokens,
                                   chunk=chunk, tp=tp, act_bytes=act_bytes)


def drafter_engine(shape: Any, cfg: Any, *, tp: int, batched: int, seqs: int, k: int,
                   engine_bytes: int) -> tuple[int, int, int]:
    """(weights bytes, attention layers of KV cache, step activation bytes) of the external drafter on one GPU of
    an engine drafting k tokens for up to ``seqs`` sequences: EAGLE-3 has one layer, DFlash one per drafter layer
    (vLLM writes every layer's context K/V)."""
    if external_drafter_kind(cfg) == DFLASH:
        s = dflash_settings(cfg, shape)
        return (dflash_engine_weight_bytes(shape, s, tp=tp, engine_bytes=engine_bytes), s.layers,
                dflash_engine_activation_bytes(shape, s, tp=tp, batched=batched, seqs=seqs, k=k,
                                               engine_bytes=engine_bytes))
    return (eagle3_engine_weight_bytes(shape, tp=tp, engine_bytes=engine_bytes), 1,
            eagle3_engine_activation_bytes(shape, batched=batched, engine_bytes=engine_bytes))
