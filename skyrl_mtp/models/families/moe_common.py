"""What the mixture-of-experts families share: the HF router/expert fields, their megatron-core MoE settings,
the weight rules of a MoE block, and the DeepSeek-style MTP layer layout.

HF side (DeepSeek-V3, GLM-4.5; vLLM's deepseek_v2.py / glm4_moe.py): ``mlp.gate.weight`` [E, H] (the router),
``mlp.gate.e_score_correction_bias`` [E] (noaux_tc: added to the sigmoid scores for choosing experts only),
``mlp.experts.{e}.{gate,up,down}_proj.weight`` and ``mlp.shared_experts.{gate,up,down}_proj.weight``.
Megatron side (local specs, ``SequentialMLP``): ``mlp.router.weight``, the ``mlp.router.expert_bias`` buffer,
``mlp.experts.local_experts.{e}.linear_fc{1,2}.weight`` (fc1 = [gate; up]) and ``mlp.shared_experts.*``.
The router's gating runs in float32 on both sides (megatron ``moe_router_dtype="fp32"``, HF/vLLM's fp32 gate).

Group-limited routing: HF and vLLM score a group by the sum of its top-2 biased scores; Megatron by the sum
of its top-(topk / topk_group): the families require topk / topk_group == 2 when n_group > 1.

The expert bias is mapped both ways but not updated during RL: megatron-core updates it in
``finalize_model_grads`` (not called here), so routing balance is the checkpoint's.

DeepSeek-style MTP layers (DeepSeek-V3, GLM-4.5) sit after the trunk at ``model.layers.{N + j}`` with
``enorm``, ``hnorm``, ``eh_proj`` (cat([embedding, hidden]): Megatron's order), ``shared_head.norm`` (the
final norm) and optional copies of the embedding / lm_head (``embed_tokens``, ``shared_head.head``), which
vLLM's drafter does not use (it shares the target's) and which the bridge neither needs nor writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_mtp.models.families.base import (
    ModelBuildError,
    WeightRule,
    copy_rule,
    expert_name,
    sections_rule,
    split_rule,
)

ROUTER_SCORES = ("sigmoid", "softmax")


@dataclass(frozen=True)
class MoEArgs:
    """Routed + shared experts of a MoE family's HF config."""

    num_experts: int
    topk: int
    moe_intermediate_size: int
    num_shared_experts: int
    shared_intermediate_size: int  # total width of the shared expert(s)
    score_function: str
    expert_bias: bool  # noaux_tc's e_score_correction_bias
    num_groups: int
    group_topk: int
    scaling_factor: float
    norm_topk_prob: bool
    first_dense: int  # layers 0 .. first_dense-1 are dense, then every moe_layer_freq-th layer is MoE
    layer_freq: int
    shared_expert_gate: bool = False  # Qwen3-Next: sigmoid(x @ g) scales the shared expert

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` is MoE; MTP layer j is layer num_layers + j (vLLM builds it by that index)."""
        return i >= self.first_dense and i % self.layer_freq == 0

    @classmethod
    def from_deepseek_style(cls, cfg: dict, family: str) -> MoEArgs:
        """DeepSeek-V3 / GLM-4.5 fields (first_k_dense_replace dense layers, then MoE every moe_layer_freq)."""
        need = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
        missing = [k for k in need if k not in cfg]
        if missing:
            raise ModelBuildError(f"{family} HF config is missing MoE fields {missing}")
        topk_method = cfg.get("topk_method", "noaux_tc")
        if topk_method != "noaux_tc":
            raise ModelBuildError(f"{family} topk_method={topk_method!r} is not supported; allowed: 'noaux_tc'")
        score = cfg.get("scoring_func", "sigmoid")
        if score not in ROUTER_SCORES:
            raise ModelBuildError(f"{family} scoring_func={score!r} is invalid; allowed: {ROUTER_SCORES}")
        first_dense, freq = int(cfg.get("first_k_dense_replace", 0)), int(cfg.get("moe_layer_freq", 1))
        n_shared = int(cfg.get("n_shared_experts") or 0)
        out = cls(
            num_experts=int(cfg["n_routed_experts"]), topk=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]), num_shared_experts=n_shared,
            shared_intermediate_size=n_shared * int(cfg["moe_intermediate_size"]), score_function=score,
            expert_bias=True, num_groups=int(cfg.get("n_group") or 1), group_topk=int(cfg.get("topk_group") or 1),
            scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), first_dense=first_dense, layer_freq=freq)
        out.check(family)
        return out

    def check(self, family: str) -> None:
        if self.layer_freq < 1 or self.first_dense < 0:
            raise ModelBuildError(f"{family}: moe_layer_freq={self.layer_freq} must be >= 1 and first_k_dense_replace="
                                  f"{self.first_dense} >= 0")
        if self.num_experts < 1 or not 1 <= self.topk <= self.num_experts:
            raise ModelBuildError(f"{family}: num_experts_per_tok={self.topk} must be in 1..n_routed_experts="
                                  f"{self.num_experts}")
        if self.num_experts % self.num_groups or self.group_topk > self.num_groups:
            raise ModelBuildError(f"{family}: n_group={self.num_groups} must divide n_routed_experts={self.num_experts}"
                                  f" and topk_group={self.group_topk} must be <= n_group")
        if self.num_groups > 1 and self.topk != 2 * self.group_topk:
            raise ModelBuildError(f"{family}: num_experts_per_tok={self.topk} with topk_group={self.group_topk}: "
                                  "megatron-core scores a group by its top-(topk/topk_group) experts, HF and vLLM by "
                                  "their top-2; allowed: num_experts_per_tok == 2 * topk_group (or n_group=1)")
        if self.score_function == "sigmoid" and self.topk > 1 and not self.norm_topk_prob:
            raise ModelBuildError(f"{family}: norm_topk_prob=False with sigmoid scores is not supported (megatron-core "
                                  "always renormalises sigmoid top-k weights); allowed: True")


def check_moe_parallel(family: str, moe: MoEArgs, *, tp: int, ep: int, pp: int = 1) -> None:
    """A MoE family's parallel layout: tp=1 (megatron-core trains MoE layers under tensor parallelism only with
    sequence parallelism, which the local layer spec's torch norms do not support), pp=1 (the MoE families build
    no pipeline stages) and ep dividing the experts."""
    if pp != 1:
        raise ModelBuildError(f"megatron.pp={pp} with a {family} (MoE) model: the MoE families build the whole model "
                              "on every rank (no pipeline stages); allowed: pp=1 (spread experts with megatron.ep)")
    if tp != 1:
        raise ModelBuildError(f"megatron.tp={tp} with a {family} (MoE) model: megatron-core trains MoE layers under "
                              "tensor parallelism only with sequence parallelism, which the local layer spec (torch "
                              "norms) does not support; allowed: tp=1 (spread experts with megatron.ep over "
                              "data-parallel ranks)")
    if ep < 1 or moe.num_experts % ep:
        raise ModelBuildError(f"megatron.ep={ep} must divide the {moe.num_experts} routed experts")


def moe_config_kwargs(moe: MoEArgs, num_layers: int, *, ep: int, dispatcher: str, aux_loss_coeff: float = 0.0) -> dict:
    """TransformerConfig fields of the family's MoE layers (dropless, expert tensor parallel size 1).
    ``aux_loss_coeff`` > 0 adds megatron-core's sequence-level load-balancing loss (DeepSeek-V3's) to every
    router's activations."""
    if moe.num_experts % ep:
        raise ModelBuildError(f"megatron.ep={ep} must divide the {moe.num_experts} routed experts")
    return dict(
        num_moe_experts=moe.num_experts,
        moe_layer_freq=[int(moe.is_moe_layer(i)) for i in range(num_layers)],
        moe_ffn_hidden_size=moe.moe_intermediate_size,
        moe_shared_expert_intermediate_size=moe.shared_intermediate_size or None,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_router_topk=moe.topk,
        moe_router_score_function=moe.score_function,
        moe_router_pre_softmax=moe.score_function == "softmax" and not moe.norm_topk_prob,
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=moe.num_groups if moe.num_groups > 1 else None,
        moe_router_group_topk=moe.group_topk if moe.num_groups > 1 else None,
        moe_router_topk_scaling_factor=moe.scaling_factor if moe.scaling_factor != 1.0 else None,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="seq_aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )


def dense_mlp_rules(mg: str, hf: str, intermediate: int) -> dict[str, WeightRule]:
    """A SwiGLU MLP: Megatron ``{mg}linear_fc1`` = [gate; up], ``linear_fc2`` = down (HF ``{hf}*_proj``)."""
    return {mg + "linear_fc1.weight": sections_rule([hf + "gate_proj.weight", hf + "up_proj.weight"],
                                                    [[intermediate], [intermediate]]),
            mg + "linear_fc2.weight": split_rule(hf + "down_proj.weight", 1)}


def _expert_rules(mg: str, hf: str, intermediate: int, expert: int) -> dict[str, WeightRule]:
    """One routed expert: whole tensors on the rank that holds it (expert tensor parallel size 1)."""
    def fc1_to_hf(parts):
        return list(parts[0].split([intermediate, intermediate], 0))

    names = (hf + "gate_proj.weight", hf + "up_proj.weight")
    fc1 = WeightRule(names, (None, None), lambda ts, r, n: torch.cat(ts, 0), fc1_to_hf, expert=expert)
    fc2 = WeightRule((hf + "down_proj.weight",), (None,), lambda ts, r, n: ts[0], lambda parts: [parts[0]],
                     expert=expert)
    return {expert_name(mg, expert, "linear_fc1.weight"): fc1, expert_name(mg, expert, "linear_fc2.weight"): fc2}


def moe_block_rules(moe: MoEArgs, mg: str, hf: str, *, router: str = "gate", experts: str = "experts",
                    shared: str = "shared_experts", shared_gate: str = "shared_expert_gate") -> dict[str, WeightRule]:
    """Megatron ``{mg}mlp.*`` of a MoE layer from HF ``{hf}mlp.*`` (HF sub-module names vary by family)."""
    m, h = mg + "mlp.", hf + "mlp."
    out = {m + "router.weight": copy_rule(f"{h}{router}.weight")}
    if moe.expert_bias:
        out[m + "router.expert_bias"] = copy_rule(f"{h}{router}.e_score_correction_bias")
    for e in range(moe.num_experts):
        out.update(_expert_rules(m + "experts.", f"{h}{experts}.{e}.", moe.moe_intermediate_size, e))
    if moe.shared_intermediate_size:
        out.update(dense_mlp_rules(m + "shared_experts.", f"{h}{shared}.", moe.shared_intermediate_size))
        if moe.shared_expert_gate:
            out[m + "shared_experts.gate_weight"] = copy_rule(f"{h}{shared_gate}.weight")
    return out


# ------------------------------------------------------------------------------ DeepSeek-style MTP layers

MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # of the trunk's; ignored both ways


def deepseek_style_mtp_rules(mtp_layers: int, num_layers: int, inner: str) -> tuple[dict[str, WeightRule],
                                                                                  list[tuple[str, str]]]:
    """(rules of MTP layer j's own tensors, [(Megatron prefix of its inner layer, HF prefix of its block)])."""
    out, blocks = {}, []
    for j in range(mtp_layers):
        p, h = f"mtp.layers.{j}.", f"model.layers.{num_layers + j}."
        out[p + "enorm.weight"] = copy_rule(h + "enorm.weight")
        out[p + "hnorm.weight"] = copy_rule(h + "hnorm.weight")
        out[p + "eh_proj.weight"] = split_rule(h + "eh_proj.weight", 0)
        out[p + "final_layernorm.weight"] = copy_rule(h + "shared_head.norm.weight")
        blocks.append((f"{p}{inner}.", h))
    return out, blocks


def deepseek_style_mtp_layer_indices(names) -> set[int]:
    """Layer indices of ``model.layers.{i}`` that are MTP layers: those carrying an ``eh_proj``."""
    out = set()
    for n in names:
        parts = n.split(".")
        if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[3] == "eh_proj":
            out.add(int(parts[2]))
    return out


def deepseek_style_mtp_copies(names) -> set[str]:
    """The MTP layers' copies of the embedding / lm_head: vLLM's drafter shares the target's, the policy shares
    its own, so a weight sync leaves them alone."""
    names = list(names)
    layers = deepseek_style_mtp_layer_indices(names)
    return {f"model.layers.{i}.{c}" for i in layers for c in MTP_COPIES} & set(names)


def deepseek_style_mtp_hf_names(names) -> set[str]:
    names = list(names)
    layers = deepseek_style_mtp_layer_indices(names)
    return {n for n in names if n.startswith(tuple(f"model.layers.{i}." for i in layers))} if layers else set()


def deepseek_style_ignorable(hf, num_layers: int, declared: int, mtp_layers: int) -> set[str]:
    """MTP layers the checkpoint has beyond those built, and the MTP layers' copies of embedding / lm_head."""
    out = set()
    for k in hf:
        parts = k.split(".")
        if len(parts) < 3 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            continue
        j = int(parts[2]) - num_layers
        if 0 <= j < declared and (j >= mtp_layers or ".".join(parts[3:]) in MTP_COPIES):
            out.add(k)
    return out


# ------------------------------------------------------------------------------ sizes for the memory plan

def moe_mlp_params(moe: MoEArgs, hidden: int) -> tuple[int, int, int]:
    """(router + shared experts, routed experts, replicated) parameters of one MoE layer's MLP."""
    shared = 3 * hidden * moe.shared_intermediate_size + (hidden if moe.shared_expert_gate else 0)
    routed = moe.num_experts * 3 * hidden * moe.moe_intermediate_size
    return moe.num_experts * hidden + shared, routed, moe.num_experts if moe.expert_bias else 0


def moe_active_width(moe: MoEArgs) -> int:
    """The MLP width one token runs through in a MoE layer (its top-k experts and the shared ones)."""
    return moe.topk * moe.moe_intermediate_size + moe.shared_intermediate_size


def layer_mlp_params(moe: MoEArgs, index: int, hidden: int, dense_intermediate: int) -> tuple[int, int, int]:
    """(sharded, routed experts, replicated) MLP parameters of decoder layer ``index`` (MTP layer j: num_layers + j)."""
    if moe.is_moe_layer(index):
        return moe_mlp_params(moe, hidden)
    return 3 * hidden * dense_intermediate, 0, 0


def deepseek_style_shape(*, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                         tied: bool, attention: int, attention_replicated: int, moe: MoEArgs, dense_intermediate: int,
                         mtp_layers: int, largest_attention: int, kv_cache_width: int = 0):
    """The ModelShape of a DeepSeek-style MoE model (dense first layers, MoE ones, MTP layers after the trunk:
    enorm / hnorm / eh_proj / final norm around a decoder block); ``attention`` / ``attention_replicated``: one
    layer's attention parameters (MLA or GQA)."""
    from skyrl_mtp.models.families.base import ModelShape

    def block(i: int) -> tuple[int, int, int]:
        sharded, routed, repl = layer_mlp_params(moe, i, hidden, dense_intermediate)
        return attention + sharded, routed, attention_replicated + repl + 2 * hidden

    trunk = [block(i) for i in range(layers)]
    mtp = [block(layers + j) for j in range(mtp_layers)]
    return ModelShape(
        hidden=hidden, layers=layers, attention_layers=layers, kv_cache_width=kv_cache_width,
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=moe_active_width(moe), vocab=vocab,
        params_sharded=sum(b[0] for b in trunk) + vocab * hidden * (1 if tied else 2),
        params_replicated=sum(b[2] for b in trunk) + hidden, expert_params=sum(b[1] for b in trunk),
        mtp_layers=mtp_layers, mtp_params_sharded=sum(b[0] for b in mtp) + mtp_layers * 2 * hidden * hidden,
        mtp_params_replicated=sum(b[2] for b in mtp) + mtp_layers * 3 * hidden,
        mtp_expert_params=sum(b[1] for b in mtp),
        largest_tensor=max(vocab * hidden, moe.num_experts * hidden, hidden * dense_intermediate, largest_attention))
