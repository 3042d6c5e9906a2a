"""Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``, ``Qwen3_5MoeForConditionalGeneration``): Qwen3.5's hybrid Gated DeltaNet
+ gated attention trunk (qwen3_5.py, with its unfused ``in_proj_qkv`` / ``z`` / ``b`` / ``a`` projections) and
Qwen3-Next's mixture-of-experts MLP in every layer (qwen3_next.py: softmax top-k routing renormalised over the
chosen experts, a shared expert scaled by a sigmoid gate), its one MTP layer ``mtp.*`` included.

Checkpoints (vLLM qwen3_5.py / qwen3_5_mtp.py, transformers modeling_qwen3_5_moe.py): the config nests the text
model in ``text_config`` (``model_type`` "qwen3_5_moe_text") for the multimodal layout; the trunk's routed experts
are stored packed, ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]
(packed_experts.py reads and writes them per expert), the MTP layer's one by one (Qwen3.6 packs those too:
either is read). vLLM's drafter (``Qwen3_5MoeMTP``) feeds the MTP layer as Qwen3.5 dense does: the final-normed
trunk state, no zeroing at position 0, layer ``spec_step_idx % layers`` (0 under the V1 runner).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from skyrl_mtp.models.families.base import ModelBuildError, WeightRule
from skyrl_mtp.models.families.moe_common import MoEArgs
from skyrl_mtp.models.families.qwen3_5 import Qwen35Args, Qwen35Family
from skyrl_mtp.models.families.qwen3_next import Qwen3NextFamily


@dataclass(frozen=True)
class Qwen35MoeArgs(Qwen35Args):
    moe: MoEArgs

    @property
    def family(self) -> Qwen35MoeFamily:
        return QWEN3_5_MOE

    @classmethod
    def from_hf_config(cls, cfg: dict) -> Qwen35MoeArgs:
        text = cfg.get("text_config", cfg)
        need = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        missing = [k for k in need if k not in text]
        if missing:
            raise ModelBuildError(f"Qwen3.5-MoE HF config is missing MoE fields {missing}")
        shared = int(text.get("shared_expert_intermediate_size") or 0)
        # vLLM's router renormalises the top-k weights unless norm_topk_prob is false; transformers' always does
        norm = bool(text.get("norm_topk_prob", True))
        if not norm:
            raise ModelBuildError("Qwen3.5-MoE norm_topk_prob=False: transformers' Qwen3.5-MoE router always "
                                  "renormalises the top-k weights; allowed: True")
        moe = MoEArgs(num_experts=int(text["num_experts"]), topk=int(text["num_experts_per_tok"]),
                      moe_intermediate_size=int(text["moe_intermediate_size"]), num_shared_experts=int(shared > 0),
                      shared_intermediate_size=shared, score_function="softmax", expert_bias=False, num_groups=1,
                      group_topk=1, scaling_factor=1.0, norm_topk_prob=norm, first_dense=0, layer_freq=1,
                      shared_expert_gate=shared > 0)
        moe.check("Qwen3.5-MoE")
        base = Qwen35Args.from_hf_config(cfg, dense_mlp=False)
        return cls(**{f.name: getattr(base, f.name) for f in fields(Qwen35Args)}, moe=moe)


class Qwen35MoeFamily(Qwen3NextFamily):
    """Qwen3-Next's MoE blocks, sizes and parallel rules on Qwen3.5's checkpoint layout (config keys, GDN
    projections, multimodal prefix, vLLM import shim)."""

    name = "qwen3_5_moe"
    architectures = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
    model_types = ("qwen3_5_moe_text", "qwen3_5_moe")
    mtp_config_key = "mtp_num_hidden_layers"

    def args_from_config(self, hf_cfg: dict) -> Qwen35MoeArgs:
        return Qwen35MoeArgs.from_hf_config(hf_cfg)

    def declared_mtp_layers(self, hf_cfg: dict) -> int:
        return Qwen35Family.declared_mtp_layers(self, hf_cfg)

    def _gdn_rules(self, args: Qwen35MoeArgs, mg: str, hf: str) -> dict[str, WeightRule]:
        return Qwen35Family._gdn_rules(self, args, mg, hf)

    def prepare_vllm_import(self) -> None:
        Qwen35Family.prepare_vllm_import(self)


QWEN3_5_MOE = Qwen35MoeFamily()
