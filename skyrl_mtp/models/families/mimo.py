"""MiMo: the dense Qwen2 trunk of dense_common.py (q/k/v bias, RMSNorm, SwiGLU, RoPE) with MiMo's MTP layers.

vLLM's MiMo drafter (vllm/model_executor/models/mimo.py, mimo_mtp.py) feeds its MTP layer the trunk
hidden state BEFORE the final norm, projects ``input_proj(cat([hidden_layernorm(h), token_layernorm(e)]))``
(hidden first; Megatron's eh_proj takes the embedding first, so the bridge swaps the column halves) and
zeroes the token embedding at position 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_mtp.models.families.base import MTPReplayInputs, WeightRule, copy_rule, swap_halves_rule
from skyrl_mtp.models.families.dense_common import DenseArgs, DenseFamily, dense_fields, rope_settings
from skyrl_mtp.models.families.megatron_common import mtp_inner_layer_name


@dataclass(frozen=True)
class HFModelArgs(DenseArgs):
    """The fields of an HF Qwen2/MiMo config.json that the Megatron model needs."""

    @property
    def family(self) -> MiMoFamily:
        return MIMO

    @classmethod
    def from_hf_config(cls, cfg: dict) -> HFModelArgs:
        theta, _ = rope_settings(cfg, "MiMo", llama3_scaling=False)
        return cls(**dense_fields(cfg, "MiMo"), rope_theta=theta, rope_scaling_factor=None, qk_norm=False,
                   qkv_bias=bool(cfg.get("attention_bias", True)),
                   num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0))


class MiMoFamily(DenseFamily):
    name = "mimo"
    architectures = ("MiMoForCausalLM",)
    model_types = ()  # MiMo checkpoints say model_type "qwen2": only the architecture identifies them
    args_class = HFModelArgs
    has_mtp_layers = True
    mtp_replay_inputs = MTPReplayInputs(hidden="pre_norm", zero_embedding_at_position_0=True)
    engine_overrides: dict = {}
    supports_packed_sequences = True
    hf_mtp_prefixes = ("model.mtp_layers.",)

    def _mtp_block_spec(self, config, layer_spec, mtp_num_layers: int, *, te: bool, pp_rank: int):
        if mtp_num_layers == 0:   # None on every stage but the last (megatron-core places MTP there)
            return None
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        return get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=te, pp_rank=pp_rank)

    def _mtp_weight_rules(self, args: HFModelArgs, mtp_layers: int) -> dict[str, WeightRule]:
        out = {}
        for j in range(mtp_layers):
            p, h = f"mtp.layers.{j}.", f"model.mtp_layers.{j}."
            out.update(self._block_rules(args, p + mtp_inner_layer_name() + ".", h))
            out[p + "enorm.weight"] = copy_rule(h + "token_layernorm.weight")
            out[p + "hnorm.weight"] = copy_rule(h + "hidden_layernorm.weight")
            out[p + "eh_proj.weight"] = swap_halves_rule(h + "input_proj.weight")
            out[p + "final_layernorm.weight"] = copy_rule(h + "final_layernorm.weight")
        return out

    def ignorable_hf_names(self, args: HFModelArgs, mtp_layers: int, hf: dict) -> set[str]:
        out = super().ignorable_hf_names(args, mtp_layers, hf)
        for k in hf:   # MTP layers the checkpoint has but this model does not build
            if k.startswith("model.mtp_layers.") and mtp_layers <= int(k.split(".")[2]) < args.num_nextn_predict_layers:
                out.add(k)
        return out


MIMO = MiMoFamily()
