"""Qwen3-Next (``Qwen3NextForCausalLM``): Qwen3.5's hybrid Gated DeltaNet + gated attention trunk (qwen3_5.py) with
a mixture-of-experts MLP in every layer (softmax top-k routing, a shared expert scaled by a sigmoid gate) and
one MTP layer ``mtp.*`` (its block MoE too).

Differences from Qwen3.5 dense, in the checkpoint (vLLM qwen3_next.py, transformers modeling_qwen3_next.py):
- the Gated DeltaNet input projections are fused per key-head group: ``in_proj_qkvz`` holds, for each of the
  ``linear_num_key_heads`` groups, [q_g; k_g; v_g; z_g] (v and z: the group's value heads), ``in_proj_ba``
  holds [b_g; a_g]; Megatron's ``GatedDeltaNet.in_proj`` keeps [q; k; v; z; b; a] (``qkvz_ba_rule``); a
  tensor-parallel rank owns whole groups of both;
- MLPs: ``mlp.gate`` (router), ``mlp.experts.{e}.*``, ``mlp.shared_expert.*``, ``mlp.shared_expert_gate``
  (megatron-core's ``moe_shared_expert_gate``);
- the MTP layer count is ``num_nextn_predict_layers`` (released checkpoints write ``mtp_num_hidden_layers``;
  vLLM's drafter reads the first and defaults to 1: either is read here).
vLLM's drafter (qwen3_next_mtp.py) feeds the MTP layer as Qwen3.5's does (post-norm target state, no zeroing at
position 0) and ignores ``spec_step_idx``: one layer at every depth whatever the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from skyrl_mtp.models.families.base import ModelBuildError, ModelShape, WeightRule, copy_rule
from skyrl_mtp.models.families.moe_common import (
    MoEArgs,
    check_moe_parallel,
    moe_active_width,
    moe_block_rules,
    moe_config_kwargs,
    moe_mlp_params,
)
from skyrl_mtp.models.families.qwen3_5 import Qwen35Args, Qwen35Family


@dataclass(frozen=True)
class Qwen3NextArgs(Qwen35Args):
    moe: MoEArgs

    @property
    def family(self) -> Qwen3NextFamily:
        return QWEN3_NEXT

    @classmethod
    def from_hf_config(cls, cfg: dict) -> Qwen3NextArgs:
        need = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        missing = [k for k in need if k not in cfg]
        if missing:
            raise ModelBuildError(f"Qwen3-Next HF config is missing MoE fields {missing}")
        step, dense = int(cfg.get("decoder_sparse_step", 1)), list(cfg.get("mlp_only_layers") or [])
        if step != 1 or dense:
            raise ModelBuildError(f"Qwen3-Next decoder_sparse_step={step}, mlp_only_layers={dense}: only MoE in every "
                                  "layer is supported; allowed: decoder_sparse_step=1, mlp_only_layers=[]")
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        moe = MoEArgs(num_experts=int(cfg["num_experts"]), topk=int(cfg["num_experts_per_tok"]),
                      moe_intermediate_size=int(cfg["moe_intermediate_size"]), num_shared_experts=int(shared > 0),
                      shared_intermediate_size=shared, score_function="softmax", expert_bias=False, num_groups=1,
                      group_topk=1, scaling_factor=1.0, norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                      first_dense=0, layer_freq=1, shared_expert_gate=shared > 0)
        moe.check("Qwen3-Next")
        base = Qwen35Args.from_hf_config(cfg)
        values = {f.name: getattr(base, f.name) for f in fields(Qwen35Args)}
        values["num_nextn_predict_layers"] = QWEN3_NEXT.declared_mtp_layers(cfg)
        return cls(**values, moe=moe)


def qkvz_ba_rule(qkvz: str, ba: str, *, num_k_heads: int, head_k: int, num_v_heads: int, head_v: int) -> WeightRule:
    """Megatron ``in_proj`` = [q; k; v; z; b; a] from Qwen3-Next's per-key-group fused ``in_proj_qkvz`` /
    ``in_proj_ba`` (each TP rank reads a contiguous block of whole groups of both)."""
    r = num_v_heads // num_k_heads
    qkvz_sizes, ba_sizes = [head_k, head_k, r * head_v, r * head_v], [r, r]

    def to_megatron(ts, rank, n):
        fused, gates = ts
        g = fused.shape[0] // sum(qkvz_sizes)
        q, k, v, z = fused.reshape(g, sum(qkvz_sizes), -1).split(qkvz_sizes, 1)
        b, a = gates.reshape(g, 2 * r, -1).split(ba_sizes, 1)
        return torch.cat([t.reshape(-1, fused.shape[-1]) for t in (q, k, v, z, b, a)], 0)

    def to_hf(parts):
        fused, gates = [], []
        for p in parts:
            g = p.shape[0] // (sum(qkvz_sizes) + sum(ba_sizes))
            q, k, v, z, b, a = (t.reshape(g, -1, p.shape[-1]) for t in p.split([g * s for s in qkvz_sizes + ba_sizes], 0))
            fused.append(torch.cat([q, k, v, z], 1).reshape(-1, p.shape[-1]))
            gates.append(torch.cat([b, a], 1).reshape(-1, p.shape[-1]))
        return [torch.cat(fused, 0), torch.cat(gates, 0)]

    return WeightRule((qkvz, ba), (0, 0), to_megatron, to_hf)


class Qwen3NextFamily(Qwen35Family):
    name = "qwen3_next"
    architectures = ("Qwen3NextForCausalLM",)
    model_types = ("qwen3_next",)
    mtp_config_key = "num_nextn_predict_layers"

    def args_from_config(self, hf_cfg: dict) -> Qwen3NextArgs:
        return Qwen3NextArgs.from_hf_config(hf_cfg)

    def declared_mtp_layers(self, hf_cfg: dict) -> int:
        n = hf_cfg.get("num_nextn_predict_layers", hf_cfg.get("mtp_num_hidden_layers")) or 0
        return n if isinstance(n, int) else 0

    def check_parallel(self, args: Qwen3NextArgs, *, tp: int, ep: int, pp: int = 1) -> None:
        check_moe_parallel(self.name, args.moe, tp=tp, ep=ep, pp=pp)

    def _extra_config(self, args: Qwen3NextArgs, *, ep: int, moe_dispatcher: str, moe_aux_loss_coeff: float) -> dict:
        from skyrl_mtp.models.families.megatron_no_te import fix_megatron_without_te

        fix_megatron_without_te()
        return moe_config_kwargs(args.moe, args.num_layers, ep=ep, dispatcher=moe_dispatcher,
                                 aux_loss_coeff=moe_aux_loss_coeff)

    def _layer_specs(self, config, transformer_engine: bool = False):
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

        gdn, attn, backend = super()._layer_specs(config, transformer_engine)
        moe = get_moe_module_spec_for_backend(backend, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
        gdn.submodules.mlp = attn.submodules.mlp = moe
        return gdn, attn, backend

    def memory_shape(self, args: Qwen3NextArgs, mtp_layers: int) -> ModelShape:
        """Qwen3.5's shape with every layer's dense MLP (counted at intermediate_size) replaced by the MoE one."""
        dense_shape = super().memory_shape(args, mtp_layers)
        h, dense = args.hidden_size, 3 * args.hidden_size * args.intermediate_size
        sharded, routed, replicated = moe_mlp_params(args.moe, h)
        n = args.num_layers
        return replace(dense_shape, intermediate=moe_active_width(args.moe),
                       params_sharded=dense_shape.params_sharded + n * (sharded - dense),
                       params_replicated=dense_shape.params_replicated + n * replicated, expert_params=n * routed,
                       mtp_params_sharded=dense_shape.mtp_params_sharded + mtp_layers * (sharded - dense),
                       mtp_params_replicated=dense_shape.mtp_params_replicated + mtp_layers * replicated,
                       mtp_expert_params=mtp_layers * routed)

    def _mlp_rules(self, args: Qwen3NextArgs, mg: str, hf: str) -> dict[str, WeightRule]:
        return {mg + "input_layernorm.weight": copy_rule(hf + "input_layernorm.weight"),
                mg + "pre_mlp_layernorm.weight": copy_rule(hf + "post_attention_layernorm.weight"),
                **moe_block_rules(args.moe, mg, hf, shared="shared_expert")}

    def _gdn_rules(self, args: Qwen3NextArgs, mg: str, hf: str) -> dict[str, WeightRule]:
        out = super()._gdn_rules(args, mg, hf)
        h = hf + "linear_attn."
        out[mg + "self_attention.in_proj.weight"] = qkvz_ba_rule(
            h + "in_proj_qkvz.weight", h + "in_proj_ba.weight", num_k_heads=args.linear_num_key_heads,
            head_k=args.linear_key_head_dim, num_v_heads=args.linear_num_value_heads, head_v=args.linear_value_head_dim)
        return out

    def prepare_vllm_import(self) -> None:
        """vLLM's Qwen3-Next code imports without the Qwen3.5 torchvision alias."""


QWEN3_NEXT = Qwen3NextFamily()
