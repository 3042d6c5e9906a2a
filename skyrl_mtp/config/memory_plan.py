"""GPU memory of a run, per GPU, computed from its config and the model's HF config before anything starts.

Why: a colocated run holds the policy's weights, fp32 grads and optimizer shard on every GPU while the vLLM engines
serve from the same GPU, and a step's activations and logits while they sleep; a recipe that does not fit fails
minutes into the first step (or at engine start: vLLM refuses to start unless gpu_memory_utilization x the GPU is
free). The plan adds up every part for each phase of a step, refuses a config that does not fit
`trainer.placement.gpu_memory_gb` (naming settings that would), sets the engines' `gpu_memory_utilization`, and
decides whether grads and optimizer state go to host memory while the engines are awake.

What is counted (bytes per GPU; the formulas are the functions of config/memory_formulas.py and, for a drafter
trained beside the policy, config/memory_drafter.py, each citing the megatron-core / torch / vLLM code it models,
checked by hand and against eight rows measured on an H200 in tests/unit/cluster/test_memory_plan.py):
- policy (Megatron, TP x DP): bf16 weights, fp32 grad buffer (DDP grad_reduce_in_fp32), distributed optimizer
  (fp32 master copy + Adam's two moments, sharded over DP), for the policy and, separately, the MTP head; an
  EAGLE-3 or DFlash drafter's fp32 weights, grads and AdamW moments, whole on every rank;
- a training step in three phases, each on top of that state: forward and backward (a micro-batch's saved
  activations, with or without full recompute, one attention layer's backward and the logits), the draft loss
  (after the policy's backward: the logits and the MTP head's replay, or an external drafter's captured states,
  passes and fp32 attention scores: EAGLE-3's unrolled passes over every position, DFlash's context pass and its
  query pass over the trained blocks), the optimizer step (torch's foreach AdamW allocates an fp32
  temporary of every parameter; the fused kernels none). The attention that runs
  (megatron.layer_impl): the local spec keeps the [S, S] softmax (fp32) and its bf16 copy per head, writes the raw
  scores into a global buffer that outlives the step, and its backward holds fp32 gradients of one layer's scores;
  SDPA's and Transformer Engine's kernels keep q, k, v and the output only. The policy's forward does not run the
  MTP layers (mtp/native_loss_patch.py); the draft loss replays them;
- the engine (per GPU of an engine): weights, drafter (MTP layers, or EAGLE-3's / DFlash's layers and the aux
  states they read), KV cache (generator.kv_cache_memory_mb) and how many tokens it holds (the drafter's layers' K
  and V too), activations of a max_num_batched_tokens step, CUDA graphs, vLLM's gpu_memory_utilization;
- fixed allowances per process (CUDA context, NCCL: outside torch's allocator), the cuBLAS workspaces torch's
  allocator counts, and a 5% headroom for fragmentation (what the allocator reserves beyond what it hands out:
  benchmarks/train_step_gpu.py reports torch.cuda.max_memory_reserved next to max_memory_allocated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from skyrl_mtp.config.memory_advice import fmt_bytes, plan_problems
from skyrl_mtp.config.memory_drafter import (
    DRAFTER_STATE_BYTES,
    DRAFTER_WEIGHT_BYTES,
    drafter_draft_loss_parts,
    drafter_engine,
    drafter_param_count,
    external_drafter_kind,
)
from skyrl_mtp.config.memory_formulas import (  # noqa: F401 - the plan's numbers, importable from here as before
    CUDA_GRAPHS,
    DRAFT_CHUNK_BYTES_PER_LOGIT,
    DTYPE_BYTES,
    ENGINE_OVERHEAD,
    FOREACH_ADAM_TEMP_BYTES,
    GIB,
    HEADROOM,
    MIB,
    POLICY_OVERHEAD,
    VLLM_BATCHED_TOKENS,
    WORKSPACES,
    activation_bytes,
    attention_backward_bytes,
    attention_buffer_bytes,
    attention_score_bytes,
    draft_loss_bytes,
    ipc_buffer_bytes,
    kv_bytes_per_token,
    layer_activation_elements,
    logits_bytes,
    train_sequence_length,
)
from skyrl_mtp.errors import problem


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
    # a drafter trained beside the model (EAGLE-3, DFlash): its fp32 weights, grads and AdamW moments, whole on every
    # rank; of them the weights (there from the start); its draft loss by part (they sum to draft_loss)
    drafter: int = 0
    drafter_weights: int = 0
    draft_parts: tuple[tuple[str, int], ...] = ()

    @property
    def resident(self) -> int:
        return self.weights + self.grads + self.optimizer + self.drafter + self.overhead

    @property
    def offloaded(self) -> int:
        """What stays on the GPU with grads and optimizer state in host memory (a drafter's stay: its optimizer side
        moves nothing)."""
        return self.weights + self.drafter + self.overhead

    @property
    def at_engine_start(self) -> int:
        """What the policy holds when colocated engines start with its grads and optimizer state in host memory:
        weights (the drafter's fp32 ones too) and overhead; without offload its grad buffer and fp32 master copy come
        on top. Adam's moments and the drafter's grads come with the first step."""
        return self.weights + self.drafter_weights + self.overhead

    @property
    def step_phases(self) -> dict[str, dict[str, int]]:
        """Each phase of a training step: its parts beyond the resident state. Forward and backward: a micro-batch's
        saved activations, one attention layer's backward and the logits' working set (the latter two do not
        coincide in time: their sum is the plan's margin); the draft loss, after the policy's backward: the logits it
        keeps as teacher and the head's replay (an external drafter's: its parts); the optimizer step: its
        temporaries."""
        common = {"attention buffer": self.attention_buffer, "workspaces": self.workspaces}
        out = {"forward and backward": {"activations": self.activations, "attention backward": self.attention_backward,
                                        "logits": self.logits, **common}}
        if self.draft_loss:
            parts = dict(self.draft_parts) or {"draft loss": self.draft_loss}
            out["draft loss"] = {"logits": self.logits, **parts, **common}
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
    external = external_drafter_kind(cfg) is not None   # it takes the MTP layers' place (trainer/run_plan.py)
    head = head and bool(cfg.trainer.mtp.enabled) and shape.mtp_layers > 0 and not external
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
    chunk = chunk_tokens(m.mtp_loss_chunk_size, shape.vocab // tp) or draft_tokens
    draft, parts, drafter = 0, {}, 0
    if head:
        draft = draft_loss_bytes(shape, draft_tokens=draft_tokens, chunk=chunk, tp=tp, act_bytes=pbytes, depths=depths,
                                 rows=rows, seq=seq, flash=flash)
    elif external and in_flight == 1:   # beside the model, on the (only) stage, the one with the logits
        drafter = drafter_param_count(shape, cfg)
        parts = drafter_draft_loss_parts(shape, cfg, rows=rows, seq=seq, draft_tokens=draft_tokens, chunk=chunk, tp=tp,
                                         act_bytes=pbytes)
        draft = sum(parts.values())
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
                        optimizer_step=0 if fused_adam else FOREACH_ADAM_TEMP_BYTES * max(shards),
                        drafter=drafter * DRAFTER_STATE_BYTES, drafter_weights=drafter * DRAFTER_WEIGHT_BYTES,
                        draft_parts=tuple(parts.items()))


def policy_memory(shape: Any, cfg: Any, *, flash: bool, fused_adam: bool = True) -> PolicyMemory:
    """One policy rank's memory; under pipeline parallelism, that of the stage with the higher training peak.
    ``flash``: the attention never materialises its scores (megatron.layer_impl sdpa or transformer_engine);
    ``fused_adam``: the optimizers step with fused kernels (the policy worker's default on GPUs, TE's / apex's
    FusedAdam), else torch's foreach AdamW (megatron-core's fallback as it builds it)."""
    stages = [_stage_memory(s, cfg, flash=flash, head=head, in_flight=n, frozen=frozen, fused_adam=fused_adam)
              for s, head, n, frozen in pipeline_stages(shape, int(cfg.megatron.pp))]
    return max(stages, key=lambda p: (p.resident + p.step, p.resident))


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
    kv = int(g.kv_cache_memory_mb) * MIB
    seqs = int(g.max_num_seqs)
    batched = int(dict(g.engine_kwargs).get("max_num_batched_tokens", VLLM_BATCHED_TOKENS))
    # a step of `batched` tokens through one layer at a time, and the sampler's fp32 logits (and probabilities) of
    # every running sequence's k + 1 verified positions over the whole vocabulary
    act = batched * (4 * shape.hidden + 3 * shape.intermediate // tp) * ebytes + seqs * (k + 1) * shape.vocab * 4 * 2
    drafter, drafter_layers = 0, 0
    if k > 0 and external_drafter_kind(cfg) is not None:   # its layers, and the target's aux states it reads
        drafter, drafter_layers, drafter_act = drafter_engine(shape, cfg, tp=tp, batched=batched, seqs=seqs, k=k,
                                                              engine_bytes=ebytes)
        act += drafter_act
    elif k > 0 and shape.mtp_layers > 0:
        drafter = ((shape.mtp_params_sharded + shape.mtp_expert_params) // tp + shape.mtp_params_replicated) * ebytes
        drafter_layers = shape.mtp_layers
    # hybrid models: every running sequence's GDN state, in the KV pool (vLLM's mamba_cache_dtype "auto": the model's)
    linear_state = seqs * shape.linear_state // tp * ebytes
    per_token = kv_bytes_per_token(shape, tp=tp, kv_bytes=ebytes, drafter_layers=drafter_layers)
    # vLLM's tensor parallelism shards the routed experts too
    return EngineMemory(weights=((shape.params_sharded + shape.expert_params) // tp + shape.params_replicated) * ebytes,
                        drafter=drafter,
                        kv_cache=kv, activations=act, cuda_graphs=0 if bool(g.enforce_eager) else CUDA_GRAPHS,
                        kv_tokens=max(kv - linear_state, 0) // per_token)


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
        at_start = pol.at_engine_start + (0 if offload else pol.grads + pol.master_weights) + eng.overhead
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
             f"    logits {fmt_bytes(p.logits)}, draft loss ({'below' if p.draft_parts else 'teacher rows, chunk, replay'}) "
             f"{fmt_bytes(p.draft_loss)}, "
             f"overhead {fmt_bytes(p.overhead)}",
             *([f"    drafter beside the model (fp32 weights, grads, AdamW; whole on every rank) {fmt_bytes(p.drafter)}; "
                "its draft loss: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in p.draft_parts)] if p.drafter else []),
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
