"""An external drafter's part of the GPU memory plan (trainer.drafter.kind=eagle3), per GPU.

Why a module of its own: an EAGLE-3 drafter is not part of the Megatron model, so none of memory_formulas' terms
count it, and it is laid out unlike the policy: it lives beside the model on every policy rank in fp32 whatever the
policy's dtype, whole on every tensor-parallel rank, with a torch AdamW of its own that data parallelism does not
shard (policy/drafter_training.py Eagle3Training: ``TorchSideOptimizer(..., tp_group=None)``); its loss re-runs it
over every position of a micro-batch after the policy's backward (mtp/eagle3_loss.py), its attention materialising
[rows, heads, S, S] scores in fp32 (drafters/eagle3.py Eagle3Attention); and the engines serve it with one attention
layer of KV cache of its own. The shapes are the target's (drafters/eagle3.py Eagle3Config.from_target: hidden size,
MLP width, heads, kv heads, head dim), read here off the target's ModelShape.
"""

from __future__ import annotations

from typing import Any

EAGLE3 = "eagle3"
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
