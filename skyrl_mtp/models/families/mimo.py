"""MiMo (Qwen2 trunk: qkv bias, RMSNorm, SwiGLU, RoPE) with MiMo's MTP layers.

vLLM's MiMo drafter (vllm/model_executor/models/mimo.py, mimo_mtp.py) feeds its MTP layer the trunk
hidden state BEFORE the final norm, projects ``input_proj(cat([hidden_layernorm(h), token_layernorm(e)]))``
(hidden first; Megatron's eh_proj takes the embedding first, so the bridge swaps the column halves) and
zeroes the token embedding at position 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_mtp.models.families.base import (
    ModelBuildError,
    ModelFamily,
    ModelShape,
    MTPReplayInputs,
    WeightMappingError,
    WeightRule,
    copy_rule,
    grouped_qkv_rule,
    sections_rule,
    split_rule,
    swap_halves_rule,
)
from skyrl_mtp.models.families.megatron_common import (
    check_divisible,
    check_dtype,
    common_config_kwargs,
    gated_rmsnorm_decoder_kwargs,
    mtp_inner_layer_name,
    pipeline_stage_flags,
    rename_for_transformer_engine,
    rope_base,
    set_core_attention,
    transformer_engine_available,
    use_transformer_engine,
)


@dataclass(frozen=True)
class HFModelArgs:
    """The fields of an HF Qwen2/MiMo config.json that the Megatron model needs."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    num_nextn_predict_layers: int

    @property
    def family(self) -> MiMoFamily:
        return MIMO

    @classmethod
    def from_hf_config(cls, cfg: dict) -> HFModelArgs:
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ModelBuildError(f"HF config is missing required fields {missing}")
        heads = int(cfg["num_attention_heads"])
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", True)),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
        )


def transformer_config(args: HFModelArgs, *, mtp_num_layers: int, tp: int = 1, dtype: str = "float32",
                       recompute: bool = False, pp: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_dtype(dtype)
    check_divisible(tp, num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
                    intermediate_size=args.intermediate_size, vocab_size=args.vocab_size)
    return TransformerConfig(
        **gated_rmsnorm_decoder_kwargs(args, qkv_bias=args.qkv_bias),
        **common_config_kwargs(tp=tp, dtype=dtype, mtp_num_layers=mtp_num_layers, recompute=recompute, pp=pp),
    )


# Megatron block suffix -> HF block suffix of the single-tensor parameters
_BLOCK_SIMPLE = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", 1),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", None),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", 1),
}


class MiMoFamily(ModelFamily):
    name = "mimo"
    architectures = ("MiMoForCausalLM",)
    model_types = ()  # MiMo checkpoints say model_type "qwen2": only the architecture identifies them
    mtp_replay_inputs = MTPReplayInputs(hidden="pre_norm", zero_embedding_at_position_0=True)
    engine_overrides: dict = {}
    supports_packed_sequences = True
    hf_mtp_prefixes = ("model.mtp_layers.",)

    def args_from_config(self, hf_cfg: dict) -> HFModelArgs:
        return HFModelArgs.from_hf_config(hf_cfg)

    def build_model(self, args: HFModelArgs, *, mtp_num_layers: int, tp: int = 1, ep: int = 1,
                    dtype: str = "float32", moe_dispatcher: str = "allgather", moe_aux_loss_coeff: float = 0.0,
                    recompute: bool = False, transformer_engine: bool | None = None, pp: int = 1, pp_rank: int = 0,
                    sdpa: bool = False):
        self.check_parallel(args, tp=tp, ep=ep, pp=pp)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_layer_with_transformer_engine_spec,
            get_gpt_mtp_block_spec,
        )

        te = use_transformer_engine(transformer_engine)
        stage = pipeline_stage_flags(args, pp=pp, pp_rank=pp_rank)
        config = transformer_config(args, mtp_num_layers=mtp_num_layers, tp=tp, dtype=dtype, recompute=recompute,
                                    pp=pp)
        # TE: fused RMSNorm + linear, fused / flash causal attention; local: the CPU path (materialised scores)
        layer_spec = get_gpt_layer_with_transformer_engine_spec() if te else get_gpt_layer_local_spec(normalization="RMSNorm")
        if sdpa:   # the MTP layer's spec below is built from this one: it gets the same core attention
            set_core_attention([layer_spec], te, sdpa=True)
        mtp_spec = None
        if mtp_num_layers > 0:   # None on every stage but the last (megatron-core places MTP there)
            mtp_spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=te, pp_rank=pp_rank)
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=args.vocab_size,
            max_sequence_length=args.max_position,
            **stage,
            share_embeddings_and_output_weights=args.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=rope_base(args.rope_theta),
            mtp_block_spec=mtp_spec,
        )
        return model.to(check_dtype(dtype))

    def _block_rules(self, args: HFModelArgs, mg: str, hf: str) -> dict[str, WeightRule]:
        out = {mg + m: (copy_rule(hf + h) if d is None else split_rule(hf + h, d))
               for m, (h, d) in _BLOCK_SIMPLE.items()}
        qkv = dict(heads=args.num_heads, groups=args.num_kv_heads, head_dim=args.head_dim, gated=False)
        out[mg + "self_attention.linear_qkv.weight"] = grouped_qkv_rule(
            [f"{hf}self_attn.{x}_proj.weight" for x in "qkv"], **qkv)
        if args.qkv_bias:
            out[mg + "self_attention.linear_qkv.bias"] = grouped_qkv_rule(
                [f"{hf}self_attn.{x}_proj.bias" for x in "qkv"], **qkv)
        out[mg + "mlp.linear_fc1.weight"] = sections_rule(
            [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"],
            [[args.intermediate_size], [args.intermediate_size]])
        return out

    def weight_rules(self, args: HFModelArgs, mtp_layers: int, *,
                     transformer_engine: bool | None = None) -> dict[str, WeightRule]:
        rules = self._local_weight_rules(args, mtp_layers)
        te = transformer_engine_available() if transformer_engine is None else transformer_engine
        return rename_for_transformer_engine(rules) if te else rules

    def _local_weight_rules(self, args: HFModelArgs, mtp_layers: int) -> dict[str, WeightRule]:
        out = {"embedding.word_embeddings.weight": split_rule("model.embed_tokens.weight", 0)}
        for i in range(args.num_layers):
            out.update(self._block_rules(args, f"decoder.layers.{i}.", f"model.layers.{i}."))
        out["decoder.final_layernorm.weight"] = copy_rule("model.norm.weight")
        for j in range(mtp_layers):
            p, h = f"mtp.layers.{j}.", f"model.mtp_layers.{j}."
            out.update(self._block_rules(args, p + mtp_inner_layer_name() + ".", h))
            out[p + "enorm.weight"] = copy_rule(h + "token_layernorm.weight")
            out[p + "hnorm.weight"] = copy_rule(h + "hidden_layernorm.weight")
            out[p + "eh_proj.weight"] = swap_halves_rule(h + "input_proj.weight")
            out[p + "final_layernorm.weight"] = copy_rule(h + "final_layernorm.weight")
        if not args.tie_word_embeddings:
            out["output_layer.weight"] = split_rule("lm_head.weight", 0)
        return out

    def memory_shape(self, args: HFModelArgs, mtp_layers: int) -> ModelShape:
        h, a, g, d, f, v = (args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim,
                            args.intermediate_size, args.vocab_size)
        attention = 2 * h * a * d + 2 * h * g * d + ((a + 2 * g) * d if args.qkv_bias else 0)   # q, o, k, v (+bias)
        block = attention + 3 * h * f                                                        # + gate, up, down
        embed_and_head = v * h * (1 if args.tie_word_embeddings else 2)
        return ModelShape(
            hidden=h, layers=args.num_layers, attention_layers=args.num_layers, heads=a, kv_heads=g, head_dim=d,
            intermediate=f, vocab=v, params_sharded=args.num_layers * block + embed_and_head,
            params_replicated=args.num_layers * 2 * h + h, mtp_layers=mtp_layers,
            mtp_params_sharded=mtp_layers * (block + 2 * h * h),   # + input_proj [h, 2h]
            mtp_params_replicated=mtp_layers * 5 * h,              # block norms, token/hidden/final norms
            largest_tensor=max(v * h, f * h, a * d * h))

    def ignorable_hf_names(self, args: HFModelArgs, mtp_layers: int, hf: dict) -> set[str]:
        out = set()
        for k in hf:
            if k.startswith("model.mtp_layers."):
                j = int(k.split(".")[2])
                if mtp_layers <= j < args.num_nextn_predict_layers:
                    out.add(k)  # MTP layers the checkpoint has but this model does not build
            if k == "lm_head.weight" and args.tie_word_embeddings:
                if "model.embed_tokens.weight" in hf and not torch.equal(hf[k], hf["model.embed_tokens.weight"]):
                    raise WeightMappingError(
                        "tie_word_embeddings=True but lm_head.weight differs from model.embed_tokens.weight")
                out.add(k)
        return out


MIMO = MiMoFamily()
