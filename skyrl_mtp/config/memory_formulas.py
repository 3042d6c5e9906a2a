"""The GPU memory plan's numbers and per-component formulas: bytes of one part of a run on one GPU, each a pure
function of the model's shape (models/families ModelShape) and a few settings, citing the code whose memory it
counts.

Why a module of its own: config/memory_plan.py assembles these parts into the phases of a step and the verdict, and
config/memory_drafter.py adds an external drafter's; the arithmetic of each part is read and tested here, apart
from how the plan combines them.
"""

from __future__ import annotations

from typing import Any

GIB = 2**30
MIB = 2**20
HEADROOM = 0.05                     # share of each GPU kept free (allocator fragmentation)
POLICY_OVERHEAD = int(1.5 * GIB)    # a policy rank's CUDA context, NCCL communicators, Megatron's buffers
ENGINE_OVERHEAD = 1 * GIB           # an engine worker's CUDA context, NCCL, vLLM workspaces
CUDA_GRAPHS = 1 * GIB               # vLLM's graph pool (enforce_eager=false); kept while a sleep-mode engine sleeps
VLLM_BATCHED_TOKENS = 16384         # vLLM 0.32's max_num_batched_tokens on >= 70 GB GPUs (arg_utils get_batch_defaults)
DRAFT_CHUNK_BYTES_PER_LOGIT = 16    # a draft-loss chunk: fp32 student logits, log-softmax, teacher probs, grad
# what torch's allocator holds beyond the terms below at a training step's peak: cuBLAS / cuBLASLt workspaces
# (torch allocates them through its caching allocator) and rounding; 67 MiB in every measured H200 row
WORKSPACES = 80 * MIB
# torch's foreach Adam / AdamW step: `exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)` (torch/optim/adam.py
# _multi_tensor_adam), an fp32 tensor per parameter of the group, all alive at once; the fused kernels allocate none
FOREACH_ADAM_TEMP_BYTES = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def train_sequence_length(cfg: Any) -> int:
    """Tokens per training row: prompt + response of one turn, or the engines' context for multi-turn rollouts."""
    g = cfg.generator
    if int(g.max_turns) > 1:
        return int(g.max_model_len)
    return min(int(g.max_model_len), int(cfg.data.max_prompt_length) + int(g.sampling.max_tokens))


def layer_activation_elements(shape: Any, *, linear: bool, tp: int, flash: bool) -> int:
    """Elements per token a transformer layer saves for backward (no sequence parallelism, no dropout): both norms'
    inputs and outputs (4h, whole on every TP rank), the SwiGLU MLP without Megatron's fusion (megatron/core/
    transformer/mlp.py ``glu``: linear_fc1's output [gate, up] 2f, silu(gate) f kept by the product, the product f
    kept by linear_fc2: 4f/TP), and the mixer: attention keeps q, k, v and its output ((2a + 2g)d/TP with a fused
    kernel; the local DotProductAttention repeats k and v to every head: 4ad/TP), a gated attention also the gate and
    its sigmoid (2ad/TP); a Gated DeltaNet layer its projections, conv output and gates (estimate: 3 x qkv + 3 x value
    + 2 x heads, / TP)."""
    h, a, g, d, f = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate
    out = 4 * h + 4 * f // tp
    if linear:
        return out + (3 * shape.linear_qkv + 3 * shape.linear_value + 2 * shape.linear_heads) // tp
    out += ((2 * a + 2 * g) * d if flash else 4 * a * d) // tp
    if shape.attention_gate:
        out += 2 * a * d // tp
    return out


def attention_score_bytes(shape: Any, *, rows: int, seq: int, tp: int, flash: bool) -> int:
    """The local spec's softmax per attention layer (fusions/fused_softmax.py ``forward_torch_softmax``: the scores
    converted to fp32, softmax, then back to the input dtype): [rows, heads / TP, S, S] fp32 probabilities kept by
    the softmax and their bf16 copy kept by the bmm with v; none with SDPA's or Transformer Engine's kernels."""
    return 0 if flash else rows * (shape.heads // tp) * seq * seq * (4 + 2)


def attention_buffer_bytes(shape: Any, *, rows: int, seq: int, tp: int, flash: bool, act_bytes: int) -> int:
    """The local DotProductAttention's raw scores: ``parallel_state.get_global_memory_buffer().get_tensor((b * np, sq,
    sk), query.dtype, "mpu")`` (transformer/dot_product_attention.py; core/utils.py GlobalMemoryBuffer keeps it for
    the process's life, hand_over_to_engines frees it): [rows x heads / TP, S, S] in the model dtype, once."""
    if flash or not shape.attention_layers:
        return 0
    return rows * (shape.heads // tp) * seq * seq * act_bytes


def attention_backward_bytes(shape: Any, *, rows: int, seq: int, tp: int, flash: bool) -> int:
    """One local attention layer's backward beyond the 6 B per score it saved: the softmax's backward holds its fp32
    output, the fp32 gradient coming in (the backward of the probabilities' cast to the model dtype) and the fp32
    gradient it returns (``_softmax_backward_data``) at once: 12 B per score, 6 more; none with SDPA's or Transformer
    Engine's kernels (they recompute the scores in tiles)."""
    if flash or not shape.attention_layers:
        return 0
    return rows * (shape.heads // tp) * seq * seq * 6


def activation_bytes(shape: Any, *, rows: int, seq: int, tp: int, flash: bool, recompute: bool, act_bytes: int) -> int:
    """Saved activations of one micro-batch at their peak: every trunk layer's, or with full recompute
    (transformer_block.py ``_checkpointed_forward``, one layer per checkpoint) every layer's input plus one layer's,
    re-run in backward. The policy's forward runs no MTP layer (mtp/native_loss_patch.py); the draft replay runs
    after its backward (draft_loss_bytes)."""
    tokens = rows * seq
    linear = shape.layers - shape.attention_layers
    per = {kind: layer_activation_elements(shape, linear=kind, tp=tp, flash=flash) * tokens * act_bytes
           for kind in (False, True)}
    scores = attention_score_bytes(shape, rows=rows, seq=seq, tp=tp, flash=flash)
    inputs = tokens * shape.hidden * act_bytes
    if recompute:
        one = max(per[False] + scores, per[True] if linear else 0)
        return shape.layers * inputs + one
    return shape.attention_layers * (per[False] + scores) + linear * per[True]


def logits_bytes(shape: Any, *, tokens: int, tp: int, act_bytes: int) -> int:
    """[tokens, vocab / TP] logits in the model dtype (kept: the draft loss's teacher), the fp32 copy the policy's
    vocab-parallel cross-entropy works in and keeps for backward, and the logits' grad in backward."""
    return tokens * (shape.vocab // tp) * (act_bytes + 4 + act_bytes)


def draft_loss_bytes(shape: Any, *, draft_tokens: int, chunk: int, tp: int, act_bytes: int, depths: int,
                     rows: int, seq: int, flash: bool) -> int:
    """The draft loss after the policy's backward: the teacher rows it gathers ([draft tokens, vocab / TP]), one chunk
    of the head's logits and their softmax / grad (fp32), and the MTP layer replayed at each trained depth."""
    v = shape.vocab // tp
    replay = depths * (layer_activation_elements(shape, linear=False, tp=tp, flash=flash) * rows * seq * act_bytes
                       + attention_score_bytes(shape, rows=rows, seq=seq, tp=tp, flash=flash))
    return draft_tokens * v * act_bytes + min(chunk, draft_tokens) * v * DRAFT_CHUNK_BYTES_PER_LOGIT + replay


def kv_bytes_per_token(shape: Any, *, tp: int, kv_bytes: int, drafter_layers: int = 0) -> int:
    """K and V of every attention layer for one token, on one GPU of an engine: the target's and the drafter's
    ``drafter_layers`` (its MTP layers, an EAGLE-3 drafter's one layer or a DFlash drafter's layers: the target's kv
    heads and head dim)."""
    layers = shape.attention_layers + drafter_layers
    if shape.kv_cache_width:
        return layers * shape.kv_cache_width * kv_bytes
    return 2 * layers * max(shape.kv_heads // tp, 1) * shape.head_dim * kv_bytes


def ipc_buffer_bytes(shape: Any, hf_cfg: dict, engine_dtype: str) -> int:
    """The IPC packing buffer (weight_transfer/transport.py ipc_buffer_bytes, here from the config's sizes)."""
    ckpt = DTYPE_BYTES.get(str(hf_cfg.get("torch_dtype", engine_dtype)), 4)
    need = -(-shape.largest_tensor * max(ckpt, DTYPE_BYTES[engine_dtype]) // MIB) * MIB
    return max(GIB, need)
