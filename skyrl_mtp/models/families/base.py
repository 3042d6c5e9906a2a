"""What a model family is: the one place that knows how its HF config becomes a Megatron model, how its
weights map both ways, how its MTP layer is fed (exactly as that family's vLLM drafter feeds it) and what
its vLLM engines need.

Everything family-specific lives in a subclass of ``ModelFamily``; the policy, the bridge, the draft-loss
replay and the engines ask the family of the checkpoint they were given (``families.family_for_config``).

A Megatron parameter (or mapped buffer, e.g. a router's expert bias) is mapped by a ``WeightRule``: the
HF tensors it is made of, the dimension along which a tensor-parallel rank reads a contiguous chunk of
each of them (None: the whole tensor), and the two conversions (rank-local HF chunks -> that rank's
Megatron shard; every rank's shard -> full HF tensors). A lazy TP-shard reader can load a rank's shard
without materialising the whole checkpoint.

Routed experts add an expert dimension: a family names each expert's parameters with its GLOBAL index
(``...experts.local_experts.{e}.linear_fc1.weight``) and marks the rule with ``expert=e``; under expert
parallelism each rank builds only its ``num_experts / ep`` experts, numbered locally from 0 (Megatron's
``SequentialMLP``), and ``rules_for_expert_rank`` selects and renames that rank's rules. Expert weights are
not tensor-parallel (expert tensor parallel size 1): their ``shard_dims`` are None.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

import torch

from skyrl_mtp.allowed import MODEL_RUNNERS


class ModelBuildError(ValueError):
    """The HF config cannot be turned into the requested Megatron model."""


class WeightMappingError(KeyError):
    """HF and Megatron weights do not correspond (missing / extra / wrong shape)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class WeightRule:
    hf_names: tuple[str, ...]
    shard_dims: tuple[int | None, ...]  # per HF name: the TP chunk dimension a rank reads (None = whole)
    to_megatron: Callable[[Tensors, int, int], torch.Tensor]  # (rank-local HF pieces, tp_rank, tp_size)
    to_hf: Callable[[Tensors], Tensors]  # (every TP rank's shard, by rank) -> full HF tensors
    expert: int | None = None  # the routed expert (global index) this parameter belongs to; None: not an expert


_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def expert_name(prefix: str, expert: int, suffix: str) -> str:
    """Megatron name of routed expert ``expert``'s parameter (global index; see ``rules_for_expert_rank``)."""
    return f"{prefix}local_experts.{expert}.{suffix}"


def num_routed_experts(rules: dict[str, WeightRule]) -> int:
    """Routed experts per MoE layer the rules map (0 for a dense model)."""
    return 1 + max((r.expert for r in rules.values() if r.expert is not None), default=-1)


def rules_for_expert_rank(rules: dict[str, WeightRule], ep_rank: int, ep_size: int) -> dict[str, WeightRule]:
    """The rules of the parameters expert-parallel rank ``ep_rank`` of ``ep_size`` builds: every non-expert
    rule, and its contiguous block of ``num_experts / ep_size`` experts renamed to local indices (rank r holds
    experts r*n .. r*n + n-1 as local_experts.0 .. n-1, Megatron's layout). Order is kept."""
    n = num_routed_experts(rules)
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} / ep_size={ep_size}: need 0 <= ep_rank < ep_size")
    if ep_size == 1:
        return dict(rules)
    if n == 0:
        raise WeightMappingError(f"expert parallel size ep={ep_size} needs a model with routed experts; this one has none")
    if n % ep_size:
        raise WeightMappingError(f"{n} routed experts are not divisible by expert parallel size ep={ep_size}")
    per = n // ep_size
    out = {}
    for mg, rule in rules.items():
        if rule.expert is None:
            out[mg] = rule
        elif rule.expert // per == ep_rank:
            found = _LOCAL_EXPERT.findall(mg)
            if found != [str(rule.expert)]:
                raise WeightMappingError(f"expert rule {mg!r} must name its expert once as .local_experts.{rule.expert}.")
            out[_LOCAL_EXPERT.sub(f".local_experts.{rule.expert % per}.", mg)] = rule
    return out


@dataclass(frozen=True)
class MTPReplayInputs:
    """What the family's vLLM drafter feeds its MTP layer (the replay for the draft loss feeds the same).

    hidden: the trunk hidden state depth 1 receives: "pre_norm" (before the final norm) or "post_norm".
    zero_embedding_at_position_0: the drafter zeroes the token embedding where the position id is 0.
    deeper_hidden: what depth d > 1 receives as its hidden state: the drafter's output of depth d-1, which
        vLLM 0.32's proposer feeds back (llm_base_proposer.py: ``self.hidden_states[:batch_size] =
        hidden_states``): "previous_output" = that output final-normed (MiMo, Qwen3.5, and DeepSeek-V3,
        whose MTP layer returns (pre-norm, normed) and the proposer feeds back the second,
        ``model_returns_tuple``), "previous_pre_norm" = before its final norm (GLM-4.5, whose MTP layer
        returns the pre-norm state only and applies ``shared_head.norm`` in compute_logits).
    depth_layer: which MTP layer runs depth d; "first" = layer 0 at every depth (vLLM 0.32's V1
        proposer, llm_base_proposer.py, never passes ``spec_step_idx``, so every draft step runs the first
        MTP layer), "per_depth" = layer (d-1) mod num_layers (the V2 runner's multi-module MTP drafter,
        v1/worker/gpu/spec_decode/multi_module_mtp/speculator.py, passes ``spec_step_idx = d-1`` and the
        models take it modulo their layer count). ``for_runner`` picks the one a vLLM runner drafts with.
    The concatenation order is fixed by Megatron's eh_proj (embedding first); a family whose HF
    projection concatenates the other way permutes the weight's columns in its WeightRule.
    """

    hidden: str
    zero_embedding_at_position_0: bool
    deeper_hidden: str = "previous_output"
    depth_layer: str = "first"

    def __post_init__(self) -> None:
        allowed = {"hidden": ("pre_norm", "post_norm"), "deeper_hidden": ("previous_output", "previous_pre_norm"),
                   "depth_layer": ("first", "per_depth")}
        for field, ok in allowed.items():
            if getattr(self, field) not in ok:
                raise ValueError(f"MTPReplayInputs.{field}={getattr(self, field)!r} is invalid; allowed: {ok}")

    def layer_index(self, depth: int, num_layers: int) -> int:
        """Index of the MTP layer that runs ``depth`` (1-based) given ``num_layers`` built layers."""
        if depth < 1 or num_layers < 1:
            raise ValueError(f"depth={depth} / num_layers={num_layers}: both must be >= 1")
        return 0 if self.depth_layer == "first" else (depth - 1) % num_layers

    def for_runner(self, runner: str, num_layers: int, num_speculative_tokens: int) -> MTPReplayInputs:
        """The inputs vLLM's ``runner`` ("v1" or "v2") drafts with: V1 runs layer 0 at every depth; V2 uses its
        multi-module drafter (layer d-1 at depth d) when both the layers and k exceed 1
        (``SpeculativeConfig.use_multi_module_mtp``), its single-module one (layer 0) otherwise."""
        if runner not in MODEL_RUNNERS:
            raise ValueError(f"runner={runner!r} is invalid; allowed: {MODEL_RUNNERS}")
        multi = runner == "v2" and min(num_layers, num_speculative_tokens) > 1
        return replace(self, depth_layer="per_depth" if multi else "first")


@dataclass(frozen=True)
class ModelShape:
    """What the GPU memory plan (config/memory_plan.py) needs of an architecture: parameter counts, split into
    what tensor parallelism shards and what every rank holds whole (norms), and the sizes that set activations and
    the KV cache. Counts are of the HF checkpoint's tensors (the Megatron model holds the same numbers)."""

    hidden: int
    layers: int                    # trunk layers
    attention_layers: int          # of them, softmax attention (KV cache; [S, S] scores on the local spec)
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params_sharded: int            # trunk (the policy's side), embedding and LM head included, split over TP
    params_replicated: int         # trunk, whole on every TP rank
    mtp_layers: int
    mtp_params_sharded: int        # the MTP layers' own parameters (the head's side; it shares embedding / LM head)
    mtp_params_replicated: int
    largest_tensor: int            # elements of the largest HF tensor (sizes the IPC packing buffer)
    attention_gate: bool = False   # an output gate per head on q_proj (Qwen3.5)
    linear_qkv: int = 0            # hybrid (Gated DeltaNet) layers: width of the fused q/k/v projection
    linear_value: int = 0          # ... of the value / gate (z) projections
    linear_heads: int = 0          # ... value heads
    linear_state: int = 0          # ... elements of one sequence's recurrent + conv state, over all of them
    # mixture-of-experts models: the routed experts' parameters (trunk / MTP layers), split over expert-parallel
    # ranks (expert tensor parallel size 1); `intermediate` is then the MLP width a token runs through
    expert_params: int = 0
    mtp_expert_params: int = 0
    # elements a token keeps per attention layer in vLLM's KV cache when it is not K and V of every kv head: MLA's
    # compressed latent and rope key (kv_lora_rank + qk_rope_head_dim), the same on every TP rank
    kv_cache_width: int = 0

    @property
    def params(self) -> int:
        return (self.params_sharded + self.params_replicated + self.mtp_params_sharded + self.mtp_params_replicated
                + self.expert_params + self.mtp_expert_params)


def chunk(t: torch.Tensor, dim: int | None, rank: int, size: int, what: str = "") -> torch.Tensor:
    """Rank ``rank``'s contiguous chunk of ``t`` along ``dim`` (the whole tensor for dim None)."""
    if dim is None or size == 1:
        return t
    if t.shape[dim] % size:
        raise WeightMappingError(f"{what}: dim {dim} of shape {tuple(t.shape)} is not divisible by tp={size}")
    return torch.chunk(t, size, dim=dim)[rank]


# ------------------------------------------------------------------------------ rule constructors

def copy_rule(name: str) -> WeightRule:
    """Replicated on every TP rank."""
    return WeightRule((name,), (None,), lambda ts, r, n: ts[0], lambda parts: [parts[0]])


def split_rule(name: str, dim: int) -> WeightRule:
    """Sharded along ``dim`` (0: column-parallel, 1: row-parallel)."""
    return WeightRule((name,), (dim,), lambda ts, r, n: ts[0], lambda parts: [torch.cat(parts, dim)])


def sections_rule(names: Sequence[str], sections: Sequence[Sequence[int]]) -> WeightRule:
    """Column-parallel tensors made of dim-0 sections, each section sharded on its own.

    ``sections[i]`` are the dim-0 section sizes of HF tensor ``names[i]`` (e.g. [q, k, v] of a fused GDN
    projection, or one section for a plain tensor); a rank's Megatron shard is the concatenation, over
    names and sections, of the rank's chunk of each section (Megatron's fused layouts: [gate; up],
    [q; k; v; z; b; a], ...).
    """
    names, sections = tuple(names), tuple(tuple(s) for s in sections)
    dims = tuple(0 if len(s) == 1 else None for s in sections)  # one section: the reader chunks it directly

    def to_megatron(ts, r, n):
        out = []
        for name, t, secs, dim in zip(names, ts, sections, dims):
            if sum(secs) != (t.shape[0] * (n if dim == 0 else 1)):
                raise WeightMappingError(f"{name}: shape {tuple(t.shape)} does not match sections {list(secs)}")
            if dim == 0:
                out.append(t)
            else:
                out.extend(chunk(s, 0, r, n, name) for s in torch.split(t, list(secs), 0))
        return torch.cat(out, 0)

    def to_hf(parts):
        n = len(parts)
        local = [s // n for secs in sections for s in secs]
        per_rank = [torch.split(p, local, 0) for p in parts]
        out, i = [], 0
        for secs in sections:
            out.append(torch.cat([torch.cat([pr[i + j] for pr in per_rank], 0) for j in range(len(secs))], 0))
            i += len(secs)
        return out

    return WeightRule(names, dims, to_megatron, to_hf)


def grouped_qkv_rule(names: Sequence[str], *, heads: int, groups: int, head_dim: int, gated: bool) -> WeightRule:
    """Attention q/k/v (weights or biases) in Megatron's per-query-group layout.

    Megatron's ``linear_qkv`` stores, per query group, the group's q heads, [its output-gate heads,] its
    k head, its v head. HF keeps q, k, v apart; a gated HF q_proj holds, per head, [q_h; gate_h].
    Each HF tensor is chunked on dim 0 by TP rank (a rank owns whole query groups).
    """
    names = tuple(names)
    per = heads // groups
    q_rows = 2 * head_dim if gated else head_dim

    def to_megatron(ts, r, n):
        q, k, v = ts
        g = groups // n
        rest = q.shape[1:]
        q = q.reshape(g, per, q_rows, *rest)
        parts = [q[:, :, :head_dim].reshape(g, per * head_dim, *rest)]
        if gated:
            parts.append(q[:, :, head_dim:].reshape(g, per * head_dim, *rest))
        parts += [k.reshape(g, head_dim, *rest), v.reshape(g, head_dim, *rest)]
        return torch.cat(parts, 1).reshape(-1, *rest)

    def to_hf(parts):
        qs, ks, vs = [], [], []
        for p in parts:
            rest = p.shape[1:]
            width = (per * (2 if gated else 1) + 2) * head_dim
            w = p.reshape(-1, width, *rest)
            g = w.shape[0]
            sizes = [per * head_dim] * (2 if gated else 1) + [head_dim, head_dim]
            pieces = torch.split(w, sizes, 1)
            q = pieces[0].reshape(g, per, head_dim, *rest)
            if gated:
                q = torch.cat([q, pieces[1].reshape(g, per, head_dim, *rest)], 2)
            qs.append(q.reshape(g * per * q_rows, *rest))
            ks.append(pieces[-2].reshape(g * head_dim, *rest))
            vs.append(pieces[-1].reshape(g * head_dim, *rest))
        return [torch.cat(qs, 0), torch.cat(ks, 0), torch.cat(vs, 0)]

    return WeightRule(names, (0, 0, 0), to_megatron, to_hf)


def swap_halves_rule(name: str) -> WeightRule:
    """Column-parallel [out, 2*in] projection whose two input halves Megatron takes in the other order."""

    def swap(w):
        h = w.shape[1] // 2
        return torch.cat([w[:, h:], w[:, :h]], dim=1)

    return WeightRule((name,), (0,), lambda ts, r, n: swap(ts[0]), lambda parts: [swap(torch.cat(parts, 0))])


# ------------------------------------------------------------------------------ the family


class ModelFamily:
    """Base class: subclasses fill in every method (one instance per family, registered in __init__.py)."""

    name: str = ""
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    mtp_replay_inputs: MTPReplayInputs
    # vLLM engine settings the family needs whatever the user asks (e.g. prefix caching off)
    engine_overrides: dict = {}
    # ... and those it needs on vLLM-CPU only (e.g. a dtype the CPU kernels require)
    cpu_engine_overrides: dict = {}
    # speculative_config settings its drafter needs on vLLM-CPU (vLLM picks the drafter's attention backend apart
    # from the target's: v1/spec_decode/llm_base_proposer.py never inherits it)
    cpu_draft_overrides: dict = {}
    # packed sequences (several segments per row) need every mixer to respect segment boundaries
    supports_packed_sequences: bool = True
    # HF names of the MTP head's own tensors start with one of these (the draft part of a weight sync);
    # families whose MTP tensors sit elsewhere override ``mtp_hf_names``
    hf_mtp_prefixes: tuple[str, ...] = ()
    # the config.json key giving the number of MTP layers (read in text_config when the config nests one)
    mtp_config_key: str = "num_nextn_predict_layers"

    def required_engine_kwargs(self, on_cpu: bool) -> dict:
        """The vLLM engine settings this family needs whatever the user asks (the CPU ones too on CPU)."""
        return {**self.engine_overrides, **(self.cpu_engine_overrides if on_cpu else {})}

    def declared_mtp_layers(self, hf_cfg: dict) -> int:
        n = hf_cfg.get("text_config", hf_cfg).get(self.mtp_config_key) or 0
        return n if isinstance(n, int) else 0

    def mtp_hf_names(self, names: Collection[str]) -> set[str]:
        """Those of a checkpoint's tensor ``names`` (all of them, so that a family can recognise its MTP
        layers by what they contain) that belong to its MTP head."""
        return {n for n in names if n.startswith(self.hf_mtp_prefixes)} if self.hf_mtp_prefixes else set()

    def unsynced_hf_names(self, names: Collection[str]) -> set[str]:
        """Those of a checkpoint's tensor ``names`` a weight sync neither sends nor needs: tensors the model does
        not build and vLLM does not use (e.g. DeepSeek MTP layers' copies of the shared embedding / lm_head)."""
        return set()

    def matches(self, hf_cfg: dict) -> bool:
        archs = set(hf_cfg.get("architectures") or ())
        if archs:
            return bool(archs & set(self.architectures))
        return hf_cfg.get("model_type") in self.model_types

    def args_from_config(self, hf_cfg: dict):
        raise NotImplementedError

    def check_parallel(self, args, *, tp: int, ep: int, pp: int = 1) -> None:
        """Raise ModelBuildError (naming the setting) when the model cannot be built with this layout; called
        before any distributed set-up. A dense family has no experts to spread: ep must be 1."""
        if ep != 1:
            raise ModelBuildError(f"megatron.ep={ep}: a {self.name} model has no routed experts to spread; allowed: 1")

    def build_model(self, args, *, mtp_num_layers: int, tp: int = 1, ep: int = 1, dtype: str = "float32",
                    moe_dispatcher: str = "allgather", moe_aux_loss_coeff: float = 0.0, recompute: bool = False,
                    transformer_engine: bool | None = None, pp: int = 1, pp_rank: int = 0, sdpa: bool = False):
        """A GPTModel for ``args`` (stage ``pp_rank`` of ``pp``: its layers; the MTP block on the last stage);
        model-parallel state must already be initialised. ``moe_dispatcher``: megatron-core's token dispatcher
        for MoE layers (the device decides: policy/megatron/device.py); ``recompute``: Megatron's full activation
        recompute; ``transformer_engine``: the layer spec (megatron_common.use_transformer_engine); ``sdpa``: torch's
        scaled_dot_product_attention as the local spec's core attention (megatron_common.set_core_attention)."""
        raise NotImplementedError

    def weight_rules(self, args, mtp_layers: int, *, transformer_engine: bool | None = None) -> dict[str, WeightRule]:
        """Megatron parameter name -> how it is made of HF tensors (names of the layer spec ``build_model`` builds
        with the same ``transformer_engine``; experts by global index)."""
        raise NotImplementedError

    def ignorable_hf_names(self, args, mtp_layers: int, hf: dict) -> set[str]:
        """HF tensors of the checkpoint (``hf``: name -> tensor) the model does not build (e.g. MTP layers
        beyond mtp_layers)."""
        return set()

    def memory_shape(self, args, mtp_layers: int) -> ModelShape:
        """The architecture's sizes for the GPU memory plan, with ``mtp_layers`` MTP layers built."""
        raise NotImplementedError

    def prepare_vllm_import(self) -> None:
        """Make vLLM's model code for this family importable in this process (no-op unless needed)."""
