"""GLM-4.5 (``Glm4MoeForCausalLM``): grouped-query attention with q/k/v biases, optional per-head q/k norms and
partial NeoX RoPE; DeepSeek-style MoE (sigmoid noaux_tc routing, a shared expert) after
``first_k_dense_replace`` dense layers; MTP layers at ``model.layers.{N + j}``.

vLLM (glm4_moe.py, glm4_moe_mtp.py, 0.32): the target hands the drafter its hidden state AFTER the final norm;
an MTP layer zeroes the embedding at position 0, projects ``eh_proj(cat([enorm(e), hnorm(h)]))`` (Megatron's
order), runs one GLM decoder layer and returns the state BEFORE ``shared_head.norm`` (the norm is applied in
compute_logits only). The V1 proposer feeds that pre-norm state back at the next depth ("previous_pre_norm";
``model_returns_tuple`` does not list ``Glm4MoeMTPModel``), unlike DeepSeek-V3's normed one.
Weights: the attention as MiMo's (grouped q/k/v with bias), the MoE blocks and MTP layers as moe_common.py.
Tensor parallelism is refused for MoE training (see deepseek_v3.py); experts spread with ``ep``.
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
    split_rule,
)
from skyrl_mtp.models.families.megatron_common import (
    check_divisible,
    check_dtype,
    common_config_kwargs,
    mtp_inner_layer_name,
    rope_base,
    set_core_attention,
    use_transformer_engine,
)
from skyrl_mtp.models.families.moe_common import (
    MoEArgs,
    check_moe_parallel,
    deepseek_style_ignorable,
    deepseek_style_mtp_copies,
    deepseek_style_mtp_hf_names,
    deepseek_style_mtp_rules,
    deepseek_style_shape,
    dense_mlp_rules,
    moe_block_rules,
    moe_config_kwargs,
)


@dataclass(frozen=True)
class Glm4MoeArgs:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    rope_theta: float
    partial_rotary_factor: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    moe: MoEArgs
    num_nextn_predict_layers: int

    @property
    def family(self) -> Glm4MoeFamily:
        return GLM4_MOE

    @classmethod
    def from_hf_config(cls, cfg: dict) -> Glm4MoeArgs:
        need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in need if k not in cfg]
        if missing:
            raise ModelBuildError(f"GLM-4.5 HF config is missing required fields {missing}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelBuildError(f"GLM-4.5 hidden_act={cfg.get('hidden_act')!r}; allowed: 'silu'")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ModelBuildError(f"GLM-4.5 rope type {rope.get('rope_type', rope.get('type'))!r} is not supported; "
                                  "allowed: 'default'")
        heads = int(cfg["num_attention_heads"])
        return cls(
            hidden_size=int(cfg["hidden_size"]), num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=bool(cfg.get("use_qk_norm", False)),
            moe=MoEArgs.from_deepseek_style(cfg, "GLM-4.5"),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
        )


def transformer_config(args: Glm4MoeArgs, *, mtp_num_layers: int, tp: int = 1, ep: int = 1, dtype: str = "float32",
                       moe_dispatcher: str = "allgather", aux_loss_coeff: float = 0.0,
                       recompute: bool = False):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_dtype(dtype)
    check_divisible(tp, num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
                    vocab_size=args.vocab_size)
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_heads,
        num_query_groups=args.num_kv_heads, kv_channels=args.head_dim, ffn_hidden_size=args.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=args.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=args.qkv_bias, qk_layernorm=args.qk_norm,
        **moe_config_kwargs(args.moe, args.num_layers, ep=ep, dispatcher=moe_dispatcher, aux_loss_coeff=aux_loss_coeff),
        **common_config_kwargs(tp=tp, dtype=dtype, mtp_num_layers=mtp_num_layers, recompute=recompute),
    )


class Glm4MoeFamily(ModelFamily):
    name = "glm4_moe"
    architectures = ("Glm4MoeForCausalLM",)
    model_types = ("glm4_moe",)
    mtp_replay_inputs = MTPReplayInputs(hidden="post_norm", zero_embedding_at_position_0=True,
                                        deeper_hidden="previous_pre_norm")
    supports_packed_sequences = True

    def args_from_config(self, hf_cfg: dict) -> Glm4MoeArgs:
        return Glm4MoeArgs.from_hf_config(hf_cfg)

    def mtp_hf_names(self, names) -> set[str]:
        return deepseek_style_mtp_hf_names(names)

    def unsynced_hf_names(self, names) -> set[str]:
        return deepseek_style_mtp_copies(names)

    def check_parallel(self, args: Glm4MoeArgs, *, tp: int, ep: int, pp: int = 1) -> None:
        check_moe_parallel(self.name, args.moe, tp=tp, ep=ep, pp=pp)

    def build_model(self, args: Glm4MoeArgs, *, mtp_num_layers: int, tp: int = 1, ep: int = 1,
                    dtype: str = "float32", moe_dispatcher: str = "allgather", moe_aux_loss_coeff: float = 0.0,
                    recompute: bool = False, transformer_engine: bool | None = None, pp: int = 1,
                    pp_rank: int = 0, sdpa: bool = False):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_decoder_block_spec,
            get_gpt_layer_local_spec,
            get_gpt_mtp_block_spec,
        )

        from skyrl_mtp.models.families.megatron_no_te import fix_megatron_without_te

        self.check_parallel(args, tp=tp, ep=ep, pp=pp)
        fix_megatron_without_te()
        config = transformer_config(args, mtp_num_layers=mtp_num_layers, tp=tp, ep=ep, dtype=dtype,
                                    moe_dispatcher=moe_dispatcher, aux_loss_coeff=moe_aux_loss_coeff,
                                    recompute=recompute)
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        te = use_transformer_engine(transformer_engine)   # TE's core attention only: the weights keep local names
        set_core_attention(block.layer_specs, te, sdpa=sdpa)
        mtp_spec = None
        if mtp_num_layers:
            kinds = {args.moe.is_moe_layer(args.num_layers + j) for j in range(mtp_num_layers)}
            if len(kinds) > 1:
                raise ModelBuildError(f"mtp_num_layers={mtp_num_layers}: the MTP layers mix dense and MoE blocks")
            layer = get_gpt_layer_local_spec(num_experts=config.num_moe_experts if kinds == {True} else None,
                                             qk_layernorm=args.qk_norm, normalization="RMSNorm")
            set_core_attention([layer], te, sdpa=sdpa)
            mtp_spec = get_gpt_mtp_block_spec(config, layer, use_transformer_engine=False)
        model = GPTModel(
            config=config, transformer_layer_spec=block, vocab_size=args.vocab_size,
            max_sequence_length=args.max_position, pre_process=True, post_process=True,
            share_embeddings_and_output_weights=args.tie_word_embeddings, position_embedding_type="rope",
            rotary_percent=args.partial_rotary_factor, rotary_base=rope_base(args.rope_theta), mtp_block_spec=mtp_spec,
        )
        return model.to(check_dtype(dtype))

    def memory_shape(self, args: Glm4MoeArgs, mtp_layers: int) -> ModelShape:
        h, a, g, d = args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim
        attention = 2 * h * a * d + 2 * h * g * d + ((a + 2 * g) * d if args.qkv_bias else 0)
        return deepseek_style_shape(hidden=h, layers=args.num_layers, heads=a, kv_heads=g, head_dim=d,
                                    vocab=args.vocab_size, tied=args.tie_word_embeddings, attention=attention,
                                    attention_replicated=2 * d if args.qk_norm else 0, moe=args.moe,
                                    dense_intermediate=args.intermediate_size, mtp_layers=mtp_layers,
                                    largest_attention=a * d * h)

    # ------------------------------------------------------------------ weights
    def _block_rules(self, args: Glm4MoeArgs, mg: str, hf: str, moe: bool) -> dict[str, WeightRule]:
        a, h = mg + "self_attention.", hf + "self_attn."
        qkv = dict(heads=args.num_heads, groups=args.num_kv_heads, head_dim=args.head_dim, gated=False)
        out = {mg + "input_layernorm.weight": copy_rule(hf + "input_layernorm.weight"),
               mg + "pre_mlp_layernorm.weight": copy_rule(hf + "post_attention_layernorm.weight"),
               a + "linear_qkv.weight": grouped_qkv_rule([f"{h}{x}_proj.weight" for x in "qkv"], **qkv),
               a + "linear_proj.weight": split_rule(h + "o_proj.weight", 1)}
        if args.qkv_bias:
            out[a + "linear_qkv.bias"] = grouped_qkv_rule([f"{h}{x}_proj.bias" for x in "qkv"], **qkv)
        if args.qk_norm:
            out[a + "q_layernorm.weight"] = copy_rule(h + "q_norm.weight")
            out[a + "k_layernorm.weight"] = copy_rule(h + "k_norm.weight")
        if moe:
            out.update(moe_block_rules(args.moe, mg, hf))
        else:
            out.update(dense_mlp_rules(mg + "mlp.", hf + "mlp.", args.intermediate_size))
        return out

    def weight_rules(self, args: Glm4MoeArgs, mtp_layers: int, *, transformer_engine: bool | None = None
                     ) -> dict[str, WeightRule]:
        out = {"embedding.word_embeddings.weight": split_rule("model.embed_tokens.weight", 0)}
        for i in range(args.num_layers):
            out.update(self._block_rules(args, f"decoder.layers.{i}.", f"model.layers.{i}.", args.moe.is_moe_layer(i)))
        out["decoder.final_layernorm.weight"] = copy_rule("model.norm.weight")
        own, blocks = deepseek_style_mtp_rules(mtp_layers, args.num_layers, mtp_inner_layer_name())
        for j, (mg, hf) in enumerate(blocks):
            out.update(self._block_rules(args, mg, hf, args.moe.is_moe_layer(args.num_layers + j)))
        out.update(own)
        if not args.tie_word_embeddings:
            out["output_layer.weight"] = split_rule("lm_head.weight", 0)
        return out

    def ignorable_hf_names(self, args: Glm4MoeArgs, mtp_layers: int, hf: dict) -> set[str]:
        out = deepseek_style_ignorable(hf, args.num_layers, args.num_nextn_predict_layers, mtp_layers)
        if args.tie_word_embeddings and "lm_head.weight" in hf:
            emb = hf.get("model.embed_tokens.weight")
            if emb is not None and not torch.equal(hf["lm_head.weight"], emb):
                raise WeightMappingError("tie_word_embeddings=True but lm_head.weight differs from embed_tokens")
            out.add("lm_head.weight")
        return out


GLM4_MOE = Glm4MoeFamily()
