"""GPU memory of a run, per GPU, computed from its config and the model's HF config before anything starts.

Why: a colocated run holds the policy's weights, fp32 grads and optimizer shard on every GPU while the vLLM engines
serve from the same GPU, and a step's activations and logits while they sleep; a recipe that does not fit fails
minutes into the first step (or at engine start: vLLM refuses to start unless gpu_memory_utilization x the GPU is
free). The plan adds up every part for each phase of a step, refuses a config that does not fit
`trainer.placement.gpu_memory_gb` (naming settings that would), sets the engines' `gpu_memory_utilization`, and
decides whether grads and optimizer state go to host memory while the engines are awake.

What is counted (bytes per GPU; the formulas are the functions below, each citing the megatron-core / torch code
it models, checked by hand and against eight rows measured on an H200 in tests/unit/cluster/test_memory_plan.py):
- policy (Megatron, TP x DP): bf16 weights, fp32 grad buffer (DDP grad_reduce_in_fp32), distributed optimizer
  (fp32 master copy + Adam's two moments, sharded over DP), for the policy and, separately, the MTP head;
- a training step in three phases, each on top of that state: forward and backward (a micro-batch's saved
  activations, with or without full recompute, one attention layer's backward and the logits), the draft loss
  (after the policy's backward: the logits and the MTP head's replay), the optimizer step (torch's foreach AdamW
  allocates an fp32 temporary of every parameter; the fused kernels none). The attention that runs
  (megatron.layer_impl): the local spec keeps the [S, S] softmax (fp32) and its bf16 copy per head, writes the raw
  scores into a global buffer that outlives the step, and its backward holds fp32 gradients of one layer's scores;
  SDPA's and Transformer Engine's kernels keep q, k, v and the output only. The policy's forward does not run the
  MTP layers (mtp/native_loss_patch.py); the draft loss replays them;
- the engine (per GPU of an engine): weights, MTP drafter, KV cache (generator.kv_cache_memory_mb) and how many
  tokens it holds, activations of a max_num_batched_tokens step, CUDA graphs, vLLM's gpu_memory_utilization;
- fixed allowances per process (CUDA context, NCCL: outside torch's allocator), the cuBLAS workspaces torch's
  allocator counts, and a 5% headroom for fragmentation (what the allocator reserves beyond what it hands out:
  benchmarks/train_step_gpu.py reports torch.cuda.max_memory_reserved next to max_memory_allocated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from skyrl_mtp.config.memory_advice import fmt_bytes, plan_problems
from skyrl_mtp.errors import problem

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


@dataclass(frozen=True)
class PolicyMemory:
    """Bytes on one policy rank's GPU."""

    weights: int
    grads: int
    optimizer: int
    master_weights: int             # of the optimizer: the fp32 copy, allocated at start (Adam's moments at step 1)
    activations: int                # saved for backward per micro-batch, as configured (recompute or not)
    activations_no_recompute: int
    activations_recompute: int
    logits: int
    draft_loss: int
    attention_buffer: int = 0       # the local attention's global score buffer (lives from the first forward on)
    attention_backward: int = 0     # one local attention layer's backward beyond what it saved
    optimizer_step: int = 0         # the optimizer step's temporaries (foreach AdamW), the larger side's
    workspaces: int = WORKSPACES
    overhead: int = POLICY_OVERHEAD

    @property
    def resident(self) -> int:
        return self.weights + self.grads + self.optimizer + self.overhead

    @property
    def offloaded(self) -> int:
        """What stays on the GPU with grads and optimizer state in host memory."""
        return self.weights + self.overhead

    @property
    def step_phases(self) -> dict[str, dict[str, int]]:
        """Each phase of a training step: its parts beyond the resident state. Forward and backward: a micro-batch's
        saved activations, one attention layer's backward and the logits' working set (the latter two do not
        coincide in time: their sum is the plan's margin); the draft loss, after the policy's backward: the logits it
        keeps as teacher and the head's replay; the optimizer step: its temporaries."""
        common = {"attention buffer": self.attention_buffer, "workspaces": self.workspaces}
        out = {"forward and backward": {"activations": self.activations, "attention backward": self.attention_backward,
                                        "logits": self.logits, **common}}
        if self.draft_loss:
            out["draft loss"] = {"logits": self.logits, "draft loss": self.draft_loss, **common}
        out["optimizer step"] = {"optimizer temporaries": self.optimizer_step, **common}
        return out

    @property
    def step_peak(self) -> tuple[str, int]:
        """(the phase of a training step that peaks, its bytes beyond the resident state)."""
        return max(((k, sum(v.values())) for k, v in self.step_phases.items()), key=lambda kv: kv[1])

    @property
    def step(self) -> int:
        """A training step's peak beyond the resident state."""
        return self.step_peak[1]

    @property
    def step_without_draft_loss(self) -> int:
        """The same with the head not trained this step (``train_step(train_head=False)``)."""
        return max(sum(v.values()) for k, v in self.step_phases.items() if k != "draft loss")


@dataclass(frozen=True)
class EngineMemory:
    """Bytes on one GPU of an engine (an engine of TP t holds 1/t of the sharded parts on each of its GPUs)."""

    weights: int
    drafter: int
    kv_cache: int
    activations: int
    cuda_graphs: int
    kv_tokens: int                  # tokens of full-length context the KV cache holds
    overhead: int = ENGINE_OVERHEAD

    @property
    def awake(self) -> int:
        return self.weights + self.drafter + self.kv_cache + self.activations + self.cuda_graphs + self.overhead

    @property
    def asleep(self) -> int:
        return self.cuda_graphs + self.overhead


@dataclass(frozen=True)
class MemoryPlan:
    device: str                     # "gpu" (enforced) or "cpu" (printed only)
    gpu_bytes: int
    colocated: bool
    attention: str                  # megatron.layer_impl's attention, in words (ATTENTION)
    train_tokens: tuple[int, int]   # (micro-batch rows, tokens per row)
    policy: PolicyMemory
    engine: EngineMemory
    ipc_buffer: int
    offload_while_engines_awake: bool
    gpu_memory_utilization: float   # what the engines get (the user's generator.engine_kwargs value if set)
    free_at_engine_start: int
    phases: dict[str, int] = field(default_factory=dict)   # name -> peak bytes per GPU
    problems: tuple[str, ...] = ()

    @property
    def usable(self) -> int:
        return int(self.gpu_bytes * (1 - HEADROOM))

    @property
    def peak(self) -> tuple[str, int]:
        return max(self.phases.items(), key=lambda kv: kv[1])

    def describe(self) -> str:
        return describe(self)


# ---------------------------------------------------------------------------------------------- the pieces

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


def pipeline_stages(shape: Any, pp: int) -> list[tuple[Any, bool, int, int]]:
    """(the stage's share of the model as a ModelShape, it holds the MTP layers, micro-batches its 1F1B schedule
    keeps in flight, parameters it holds without training them) for the stages that bound the peak: the first
    (the embedding, and pp micro-batches of activations in flight) and the last (the output layer and the MTP
    layers with their copy of the embedding). Pipeline parallelism needs an untied LM head (pipeline_stage_flags)."""
    if pp == 1:
        return [(shape, True, 1, 0)]
    embed = shape.vocab * shape.hidden
    layers = shape.params_sharded - 2 * embed

    def stage(n_layers: int) -> Any:
        return replace(shape, layers=n_layers, attention_layers=max(shape.attention_layers * n_layers // shape.layers, 1),
                       params_sharded=layers // pp + embed, params_replicated=shape.params_replicated // pp,
                       expert_params=shape.expert_params // pp,
                       linear_state=shape.linear_state // pp)

    per = shape.layers // pp
    return [(stage(per), False, pp, 0), (stage(per), True, 1, embed)]


def _stage_memory(shape: Any, cfg: Any, *, flash: bool, head: bool, in_flight: int, frozen: int,
                  fused_adam: bool = True) -> PolicyMemory:
    from skyrl_mtp.config.mtp_knob import train_depths
    from skyrl_mtp.mtp.draft_losses import chunk_tokens

    m = cfg.megatron
    tp, dp, rows, pbytes = int(m.tp), int(m.dp), int(m.micro_batch_size), DTYPE_BYTES[str(m.dtype)]
    ep = int(m.ep)
    head = head and bool(cfg.trainer.mtp.enabled) and shape.mtp_layers > 0
    trunk = shape.params_sharded // tp + shape.params_replicated
    mtp = (shape.mtp_params_sharded // tp + shape.mtp_params_replicated) if head else 0
    # routed experts: ep ranks share them out, and their optimizer state is sharded over the expert data-parallel
    # group (the tp * dp / ep ranks holding the same experts)
    experts = shape.expert_params // ep + (shape.mtp_expert_params // ep if head else 0)
    params = trunk + mtp + experts             # the head has its own grad buffer and optimizer, same layout
    master = 4 if pbytes != 4 else 0           # fp32 params are their own master copy
    expert_dp = max(tp * dp // ep, 1)
    seq = train_sequence_length(cfg)
    depths = train_depths(cfg) if head else 0
    kw = dict(rows=rows, seq=seq, tp=tp, flash=flash, act_bytes=pbytes)
    with_rc = in_flight * activation_bytes(shape, recompute=True, **kw)
    without = in_flight * activation_bytes(shape, recompute=False, **kw)
    draft_tokens = rows * min(seq, int(cfg.generator.sampling.max_tokens))
    draft = 0
    if head:
        chunk = chunk_tokens(m.mtp_loss_chunk_size, shape.vocab // tp) or draft_tokens
        draft = draft_loss_bytes(shape, draft_tokens=draft_tokens, chunk=chunk, tp=tp, act_bytes=pbytes, depths=depths,
                                 rows=rows, seq=seq, flash=flash)
    # the output layer's logits live on the stage that holds it (the last, or the only one)
    logits = logits_bytes(shape, tokens=rows * seq, tp=tp, act_bytes=pbytes) if in_flight == 1 else 0
    # each side steps its own optimizer over its own shard (the policy's trunk and experts, the head's)
    shards = (trunk // dp + shape.expert_params // ep // expert_dp,
              mtp // dp + (shape.mtp_expert_params // ep // expert_dp if head else 0))
    return PolicyMemory(weights=(params + frozen // tp) * pbytes, grads=params * 4,
                        optimizer=(trunk + mtp) * (master + 8) // dp + experts * (master + 8) // expert_dp,
                        master_weights=(trunk + mtp) * master // dp + experts * master // expert_dp,
                        activations=with_rc if bool(m.recompute_activations) else without,
                        activations_no_recompute=without, activations_recompute=with_rc,
                        logits=logits, draft_loss=draft,
                        attention_buffer=attention_buffer_bytes(shape, rows=rows, seq=seq, tp=tp, flash=flash,
                                                                act_bytes=pbytes),
                        attention_backward=attention_backward_bytes(shape, rows=rows, seq=seq, tp=tp, flash=flash),
                        optimizer_step=0 if fused_adam else FOREACH_ADAM_TEMP_BYTES * max(shards))


def policy_memory(shape: Any, cfg: Any, *, flash: bool, fused_adam: bool = True) -> PolicyMemory:
    """One policy rank's memory; under pipeline parallelism, that of the stage with the higher training peak.
    ``flash``: the attention never materialises its scores (megatron.layer_impl sdpa or transformer_engine);
    ``fused_adam``: the optimizers step with fused kernels (the policy worker's default on GPUs, TE's / apex's
    FusedAdam), else torch's foreach AdamW (megatron-core's fallback as it builds it)."""
    stages = [_stage_memory(s, cfg, flash=flash, head=head, in_flight=n, frozen=frozen, fused_adam=fused_adam)
              for s, head, n, frozen in pipeline_stages(shape, int(cfg.megatron.pp))]
    return max(stages, key=lambda p: (p.resident + p.step, p.resident))


def kv_bytes_per_token(shape: Any, *, tp: int, kv_bytes: int, drafter: bool) -> int:
    """K and V of every attention layer (the drafter's MTP layers too) for one token, on one GPU of an engine."""
    layers = shape.attention_layers + (shape.mtp_layers if drafter else 0)
    if shape.kv_cache_width:
        return layers * shape.kv_cache_width * kv_bytes
    return 2 * layers * max(shape.kv_heads // tp, 1) * shape.head_dim * kv_bytes


def engine_memory(shape: Any, cfg: Any) -> EngineMemory:
    from skyrl_mtp.config.mtp_knob import rollout_speculative_tokens

    g = cfg.generator
    tp, ebytes, k = int(g.tensor_parallel_size), DTYPE_BYTES[str(g.dtype)], rollout_speculative_tokens(cfg)
    pp = int(g.pipeline_parallel_size)
    if pp > 1:   # vLLM splits the layers over the stages; the last one (LM head, drafter) bounds the peak
        embed = shape.vocab * shape.hidden
        shape = replace(shape, attention_layers=-(-shape.attention_layers // pp),
                        params_sharded=(shape.params_sharded - 2 * embed) // pp + embed,
                        params_replicated=shape.params_replicated // pp, expert_params=shape.expert_params // pp,
                        linear_state=shape.linear_state // pp)
    drafter = k > 0 and shape.mtp_layers > 0
    kv = int(g.kv_cache_memory_mb) * MIB
    seqs = int(g.max_num_seqs)
    # hybrid models: every running sequence's GDN state, in the KV pool (vLLM's mamba_cache_dtype "auto": the model's)
    linear_state = seqs * shape.linear_state // tp * ebytes
    per_token = kv_bytes_per_token(shape, tp=tp, kv_bytes=ebytes, drafter=drafter)
    batched = int(dict(g.engine_kwargs).get("max_num_batched_tokens", VLLM_BATCHED_TOKENS))
    # a step of `batched` tokens through one layer at a time, and the sampler's fp32 logits (and probabilities) of
    # every running sequence's k + 1 verified positions over the whole vocabulary
    act = batched * (4 * shape.hidden + 3 * shape.intermediate // tp) * ebytes + seqs * (k + 1) * shape.vocab * 4 * 2
    # vLLM's tensor parallelism shards the routed experts too
    return EngineMemory(weights=((shape.params_sharded + shape.expert_params) // tp + shape.params_replicated) * ebytes,
                        drafter=((shape.mtp_params_sharded + shape.mtp_expert_params) // tp
                                 + shape.mtp_params_replicated) * ebytes if drafter else 0,
                        kv_cache=kv, activations=act, cuda_graphs=0 if bool(g.enforce_eager) else CUDA_GRAPHS,
                        kv_tokens=max(kv - linear_state, 0) // per_token)


def ipc_buffer_bytes(shape: Any, hf_cfg: dict, engine_dtype: str) -> int:
    """The IPC packing buffer (weight_transfer/transport.py ipc_buffer_bytes, here from the config's sizes)."""
    ckpt = DTYPE_BYTES.get(str(hf_cfg.get("torch_dtype", engine_dtype)), 4)
    need = -(-shape.largest_tensor * max(ckpt, DTYPE_BYTES[engine_dtype]) // MIB) * MIB
    return max(GIB, need)


# ---------------------------------------------------------------------------------------------- the plan

def on_gpu(cfg: Any) -> bool:
    pl = cfg.trainer.placement
    return int(pl.gpus_per_engine) > 0 or int(pl.gpus_per_policy_worker) > 0


def model_shape(cfg: Any, hf_cfg: dict):
    from skyrl_mtp.models.families import checkpoint_mtp_layers, family_for_config

    family = family_for_config(hf_cfg)
    _key, declared = checkpoint_mtp_layers(hf_cfg)
    n = cfg.megatron.mtp_num_layers
    mtp = 0 if not cfg.trainer.mtp.enabled else (declared if n is None else min(int(n), declared))
    return family.memory_shape(family.args_from_config(hf_cfg), mtp)


ATTENTION = {"local": "local (materialised scores)", "sdpa": "SDPA (torch scaled_dot_product_attention)",
             "transformer_engine": "flash (Transformer Engine)"}


def memory_plan(cfg: Any, hf_cfg: dict, *, suggest: bool = True) -> MemoryPlan:
    """The plan of `cfg` (a validated run config) for the model of `hf_cfg` (its config.json), with the layers
    megatron.layer_impl names (the policy workers check on their nodes that they can build them) and, on GPUs, fused
    Adam steps (the policy worker's default). `suggest`: look for settings that fit when it does not (re-plans)."""
    shape = model_shape(cfg, hf_cfg)
    layer_impl = str(cfg.megatron.layer_impl)
    flash = layer_impl != "local"
    pol, eng = policy_memory(shape, cfg, flash=flash), engine_memory(shape, cfg)
    gpu = int(float(cfg.trainer.placement.gpu_memory_gb) * 1e9)
    colocated = bool(cfg.trainer.placement.colocate) and on_gpu(cfg)
    ipc = ipc_buffer_bytes(shape, hf_cfg, str(cfg.generator.dtype)) if colocated else 0
    usable = int(gpu * (1 - HEADROOM))
    train = pol.resident + pol.step
    if colocated:
        awake = pol.resident + eng.awake
        offload = awake > usable and pol.offloaded + eng.awake <= usable
        kept = pol.offloaded if offload else pol.resident
        largest = shape.largest_tensor * DTYPE_BYTES[str(cfg.megatron.dtype)]
        phases = {"rollout (engines awake)": kept + eng.awake,
                  "weight sync": kept + eng.weights + eng.drafter + eng.cuda_graphs + eng.overhead + ipc + 2 * largest,
                  "training (engines asleep)": train + eng.asleep}
        # the policy is built first and, with offload, hands its grads and optimizer state over before the engines
        # start (trainer/launch.py); Adam's moments do not exist before the first step
        at_start = (pol.offloaded if offload else pol.weights + pol.grads + pol.master_weights + pol.overhead) \
            + eng.overhead
    else:
        offload = False
        phases = {"engine GPUs": eng.awake, "policy GPUs (training)": train}
        at_start = eng.overhead
    free = gpu - at_start
    user_util = dict(cfg.generator.engine_kwargs).get("gpu_memory_utilization")
    util = float(user_util) if user_util is not None else min(math.ceil(eng.awake / gpu * 100) / 100, 1.0)
    attention = ATTENTION[layer_impl]
    plan = MemoryPlan("gpu" if on_gpu(cfg) else "cpu", gpu, colocated, attention,
                      (int(cfg.megatron.micro_batch_size), train_sequence_length(cfg)), pol, eng, ipc, offload, util,
                      free, phases)
    if plan.device == "gpu":
        plan = replace(plan, problems=tuple(plan_problems(plan, cfg, hf_cfg, suggest, user_util is not None,
                                                               memory_plan)))
    return plan


def describe(plan: MemoryPlan) -> str:
    p, e = plan.policy, plan.engine
    rows, seq = plan.train_tokens
    head = (f"memory plan per GPU ({plan.device}; {fmt_bytes(plan.gpu_bytes)} declared, {fmt_bytes(plan.usable)} usable; "
            f"{'colocated: a policy rank and an engine rank on every GPU' if plan.colocated else 'separate pools'}; "
            f"attention: {plan.attention})")
    lines = [head, "  policy rank:",
             f"    weights {fmt_bytes(p.weights)}, grads (fp32) {fmt_bytes(p.grads)}, optimizer (fp32 master + Adam, sharded over "
             f"DP) {fmt_bytes(p.optimizer)}",
             f"    activations per micro-batch ({rows} x {seq} tokens): {fmt_bytes(p.activations)} "
             f"(without recompute {fmt_bytes(p.activations_no_recompute)}, with {fmt_bytes(p.activations_recompute)})",
             f"    logits {fmt_bytes(p.logits)}, draft loss (teacher rows, chunk, replay) {fmt_bytes(p.draft_loss)}, "
             f"overhead {fmt_bytes(p.overhead)}",
             f"    attention score buffer {fmt_bytes(p.attention_buffer)}, one attention layer's backward "
             f"{fmt_bytes(p.attention_backward)}, optimizer-step temporaries {fmt_bytes(p.optimizer_step)}, "
             f"workspaces {fmt_bytes(p.workspaces)}",
             "    a training step's phases beyond the resident state: " + ", ".join(
                 f"{k} {fmt_bytes(sum(v.values()))}" for k, v in p.step_phases.items())
             + f" (peak: {p.step_peak[0]})",
             "  engine (per GPU):",
             f"    weights {fmt_bytes(e.weights)}, drafter {fmt_bytes(e.drafter)}, KV cache {fmt_bytes(e.kv_cache)} "
             f"({e.kv_tokens} tokens), activations {fmt_bytes(e.activations)}, CUDA graphs {fmt_bytes(e.cuda_graphs)}, "
             f"overhead {fmt_bytes(e.overhead)}",
             f"    gpu_memory_utilization {plan.gpu_memory_utilization:.2f} (free when the engine starts: "
             f"{fmt_bytes(plan.free_at_engine_start)})"]
    if plan.colocated:
        lines.append(f"  IPC packing buffer {fmt_bytes(plan.ipc_buffer)}; grads and optimizer state in host memory while "
                     f"the engines are awake: {'yes' if plan.offload_while_engines_awake else 'no'}")
    lines.append("  phases: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in plan.phases.items()))
    name, peak = plan.peak
    verdict = "not enforced on CPU" if plan.device == "cpu" else (
        "fits" if not plan.problems else "DOES NOT FIT")
    lines.append(f"  peak: {fmt_bytes(peak)} ({name}) of {fmt_bytes(plan.usable)} usable: {verdict}")
    lines += [f"  ! {pr}" for pr in plan.problems]
    return "\n".join(lines)


__all__ = ["EngineMemory", "MemoryPlan", "PolicyMemory", "memory_plan", "problem"]


def layer_impl_for(cfg: Any) -> str:
    """The layers the plan counts and the policy workers build: megatron.layer_impl (a setting, not a guess from the
    submitting machine; each worker checks on its node that it can build them)."""
    return str(cfg.megatron.layer_impl)


def run_hf_config(cfg: Any) -> dict:
    """The config.json the plan sizes: model.path's, else the tiny model's (a warm start keeps its architecture)."""
    import json
    from pathlib import Path

    if cfg.model.path is not None:
        return json.loads((Path(str(cfg.model.path)) / "config.json").read_text())
    from dataclasses import fields

    from skyrl_mtp.models.tiny import TinyModelSpec, hf_config

    names = {f.name for f in fields(TinyModelSpec)}
    return hf_config(TinyModelSpec(**{k: v for k, v in dict(cfg.model.tiny).items() if k in names}), None)


def run_memory_plan(cfg: Any) -> MemoryPlan | None:
    """The plan of a run's config (None where the model's config cannot be read: the model checks name why)."""
    from skyrl_mtp.models.families import ModelBuildError

    try:
        return memory_plan(cfg, run_hf_config(cfg))
    except (OSError, ValueError, ModelBuildError):   # no config.json, not JSON, or no family knows it
        return None
