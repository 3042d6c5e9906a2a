"""The dense decoder trunk the Llama-like families share (Llama, Qwen3, and MiMo's Qwen2 trunk: a pre-norm RMSNorm
decoder with grouped-query attention, NeoX RoPE and a SwiGLU MLP): their config fields, the Megatron model, the
weight rules and the memory shape. A family module says only how its config.json differs: Llama-3 RoPE scaling
(llama.py), Qwen3's per-head q/k RMSNorm (qwen3.py), MiMo's q/k/v bias and MTP layers (mimo.py, through the
``_mtp_*`` hooks below).

Llama and Qwen3 carry no MTP layers: the policy builds none, and they draft with an external drafter
(``trainer.drafter.kind=eagle3``) or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_mtp.models.families.base import (
    ModelBuildError,
    ModelFamily,
    ModelShape,
    WeightMappingError,
    WeightRule,
    copy_rule,
    grouped_qkv_rule,
    sections_rule,
    split_rule,
)
from skyrl_mtp.models.families.megatron_common import (
    check_divisible,
    check_dtype,
    common_config_kwargs,
    gated_rmsnorm_decoder_kwargs,
    pipeline_stage_flags,
    rename_for_transformer_engine,
    rope_base,
    set_core_attention,
    transformer_engine_available,
    use_transformer_engine,
)

# megatron-core's only RoPE scaling (RotaryEmbedding._apply_scaling) is Llama 3's, with these fixed settings
LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class DenseArgs:
    """The fields of a dense (no MTP) HF config.json that the Megatron model needs; a family subclasses it to name
    itself (``family``)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    rope_theta: float
    rope_scaling_factor: float | None   # Llama 3's RoPE scaling factor; None: plain RoPE
    rms_norm_eps: float
    tie_word_embeddings: bool
    qk_norm: bool                       # per-head RMSNorm of q and k before RoPE (Qwen3)
    num_nextn_predict_layers: int = 0   # MTP layers of the checkpoint (MiMo); what resolve_mtp_layers reads
    qkv_bias: bool = False              # biases on q, k and v (Qwen2 / MiMo)

    @property
    def family(self) -> DenseFamily:
        raise NotImplementedError

    @classmethod
    def from_hf_config(cls, cfg: dict) -> DenseArgs:
        raise NotImplementedError


def refuse(family: str, key: str, value, allowed) -> ModelBuildError:
    return ModelBuildError(f"{family} config.json {key}={value!r} is not supported; allowed: {allowed}")


def rope_settings(cfg: dict, family: str, *, llama3_scaling: bool) -> tuple[float, float | None]:
    """(rope_theta, Llama 3 scaling factor or None) from either layout: ``rope_theta`` + ``rope_scaling`` (the
    checkpoints' config.json) or transformers 5's ``rope_parameters``. Any other RoPE scaling is refused by name."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling")
    scaling = dict(legacy) if legacy else params
    key = "rope_scaling" if legacy else "rope_parameters"
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    allowed = "'default' or 'llama3'" if llama3_scaling else "'default'"
    if kind != "llama3" or not llama3_scaling:
        raise refuse(family, f"{key}.rope_type", kind, allowed + " (the RoPE megatron-core computes)")
    for name, value in LLAMA3_ROPE_FIXED.items():
        if float(scaling.get(name, value)) != value:
            raise refuse(family, f"{key}.{name}", scaling.get(name),
                         f"{value} (megatron-core's Llama 3 RoPE scaling fixes it)")
    return float(theta), float(scaling.get("factor", 8.0))


def dense_fields(cfg: dict, family: str) -> dict:
    """The DenseArgs fields every dense family reads the same way (the family adds qk_norm and RoPE)."""
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in required if k not in cfg]
    if missing:
        raise ModelBuildError(f"{family} HF config is missing required fields {missing}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise refuse(family, "hidden_act", cfg.get("hidden_act"), "'silu'")
    if cfg.get("mlp_bias", False):
        raise refuse(family, "mlp_bias", True, "False")
    heads = int(cfg["num_attention_heads"])
    return dict(
        hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        max_position=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def transformer_config(args: DenseArgs, *, mtp_num_layers: int = 0, tp: int = 1, dtype: str = "float32",
                       recompute: bool = False, pp: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_dtype(dtype)
    check_divisible(tp, num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
                    intermediate_size=args.intermediate_size, vocab_size=args.vocab_size)
    return TransformerConfig(
        **gated_rmsnorm_decoder_kwargs(args, qkv_bias=args.qkv_bias),
        qk_layernorm=args.qk_norm,
        **common_config_kwargs(tp=tp, dtype=dtype, mtp_num_layers=mtp_num_layers, recompute=recompute, pp=pp),
    )


# Megatron block suffix -> (HF block suffix, TP chunk dimension) of the single-tensor parameters
_BLOCK_SIMPLE = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", 1),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", None),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", 1),
}


class DenseFamily(ModelFamily):
    """A dense decoder; subclasses set the names and ``args_class``, and a family with MTP layers (MiMo) sets
    ``has_mtp_layers`` and fills the ``_mtp_*`` hooks."""

    args_class: type[DenseArgs] = DenseArgs
    has_mtp_layers = False   # no MTP layers: validation refuses trainer.drafter.kind=mtp for drafting by it

    @property
    def mtp_replay_inputs(self):
        raise ModelBuildError(f"a {self.name} model has no MTP layers: there is no draft head to replay")

    def declared_mtp_layers(self, hf_cfg: dict) -> int:
        return super().declared_mtp_layers(hf_cfg) if self.has_mtp_layers else 0

    def args_from_config(self, hf_cfg: dict) -> DenseArgs:
        return self.args_class.from_hf_config(hf_cfg)

    def _refuse_mtp(self, key: str, n: int) -> None:
        if n and not self.has_mtp_layers:
            raise ModelBuildError(f"{key}={n}: a {self.name} model has no MTP layers; allowed: 0 (it drafts with "
                                  "trainer.drafter.kind=eagle3, or trainer.mtp.enabled=false)")

    def build_model(self, args: DenseArgs, *, mtp_num_layers: int, tp: int = 1, ep: int = 1,
                    dtype: str = "float32", moe_dispatcher: str = "allgather", moe_aux_loss_coeff: float = 0.0,
                    recompute: bool = False, transformer_engine: bool | None = None, pp: int = 1, pp_rank: int = 0,
                    sdpa: bool = False):
        self.check_parallel(args, tp=tp, ep=ep, pp=pp)
        self._refuse_mtp("mtp_num_layers", mtp_num_layers)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_layer_with_transformer_engine_spec,
        )

        te = use_transformer_engine(transformer_engine)
        stage = pipeline_stage_flags(args, pp=pp, pp_rank=pp_rank)
        config = transformer_config(args, mtp_num_layers=mtp_num_layers, tp=tp, dtype=dtype, recompute=recompute,
                                    pp=pp)
        # TE: fused RMSNorm + linear, fused / flash causal attention; local: the CPU path (materialised scores)
        layer_spec = (get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_norm) if te
                      else get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=args.qk_norm))
        if sdpa:   # an MTP layer's spec is built from this one: it gets the same core attention
            set_core_attention([layer_spec], te, sdpa=True)
        scaling = {} if args.rope_scaling_factor is None else {
            "rope_scaling": True, "rope_scaling_factor": args.rope_scaling_factor}
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=args.vocab_size,
            max_sequence_length=args.max_position,
            **stage,
            share_embeddings_and_output_weights=args.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=rope_base(args.rope_theta),
            mtp_block_spec=self._mtp_block_spec(config, layer_spec, mtp_num_layers, te=te, pp_rank=pp_rank),
            **scaling,
        )
        return model.to(check_dtype(dtype))

    def _mtp_block_spec(self, config, layer_spec, mtp_num_layers: int, *, te: bool, pp_rank: int):
        """megatron-core's MTP block spec of a family with MTP layers; None without (or off the last stage)."""
        return None

    def _block_rules(self, args: DenseArgs, mg: str, hf: str) -> dict[str, WeightRule]:
        out = {mg + m: (copy_rule(hf + h) if d is None else split_rule(hf + h, d))
               for m, (h, d) in _BLOCK_SIMPLE.items()}
        qkv = dict(heads=args.num_heads, groups=args.num_kv_heads, head_dim=args.head_dim, gated=False)
        out[mg + "self_attention.linear_qkv.weight"] = grouped_qkv_rule(
            [f"{hf}self_attn.{x}_proj.weight" for x in "qkv"], **qkv)
        if args.qkv_bias:
            out[mg + "self_attention.linear_qkv.bias"] = grouped_qkv_rule(
                [f"{hf}self_attn.{x}_proj.bias" for x in "qkv"], **qkv)
        if args.qk_norm:
            out[mg + "self_attention.q_layernorm.weight"] = copy_rule(hf + "self_attn.q_norm.weight")
            out[mg + "self_attention.k_layernorm.weight"] = copy_rule(hf + "self_attn.k_norm.weight")
        out[mg + "mlp.linear_fc1.weight"] = sections_rule(
            [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"],
            [[args.intermediate_size], [args.intermediate_size]])
        return out

    def weight_rules(self, args: DenseArgs, mtp_layers: int, *,
                     transformer_engine: bool | None = None) -> dict[str, WeightRule]:
        self._refuse_mtp("mtp_layers", mtp_layers)
        rules = {"embedding.word_embeddings.weight": split_rule("model.embed_tokens.weight", 0)}
        for i in range(args.num_layers):
            rules.update(self._block_rules(args, f"decoder.layers.{i}.", f"model.layers.{i}."))
        rules["decoder.final_layernorm.weight"] = copy_rule("model.norm.weight")
        rules.update(self._mtp_weight_rules(args, mtp_layers))
        if not args.tie_word_embeddings:
            rules["output_layer.weight"] = split_rule("lm_head.weight", 0)
        te = transformer_engine_available() if transformer_engine is None else transformer_engine
        return rename_for_transformer_engine(rules) if te else rules

    def _mtp_weight_rules(self, args: DenseArgs, mtp_layers: int) -> dict[str, WeightRule]:
        return {}

    def _block_params(self, args: DenseArgs) -> tuple[int, int]:
        """(TP-sharded, replicated) parameters of one decoder block."""
        h, a, g, d, f = args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim, args.intermediate_size
        attention = 2 * h * a * d + 2 * h * g * d + ((a + 2 * g) * d if args.qkv_bias else 0)   # q, o, k, v (+bias)
        return attention + 3 * h * f, 2 * h + (2 * d if args.qk_norm else 0)   # + gate, up, down; norms (+ q/k)

    def memory_shape(self, args: DenseArgs, mtp_layers: int) -> ModelShape:
        h, a, d, f, v = args.hidden_size, args.num_heads, args.head_dim, args.intermediate_size, args.vocab_size
        sharded, replicated = self._block_params(args)
        return ModelShape(
            hidden=h, layers=args.num_layers, attention_layers=args.num_layers, heads=a, kv_heads=args.num_kv_heads,
            head_dim=d, intermediate=f, vocab=v,
            params_sharded=args.num_layers * sharded + v * h * (1 if args.tie_word_embeddings else 2),
            params_replicated=args.num_layers * replicated + h, mtp_layers=mtp_layers,
            mtp_params_sharded=mtp_layers * (sharded + 2 * h * h),   # an MTP layer's block + its input projection
            mtp_params_replicated=mtp_layers * (replicated + 3 * h),   # + its two input norms and final norm
            largest_tensor=max(v * h, f * h, a * d * h))

    def ignorable_hf_names(self, args: DenseArgs, mtp_layers: int, hf: dict) -> set[str]:
        out = {k for k in hf if k.endswith(".rotary_emb.inv_freq")}   # older Llama checkpoints store RoPE's buffer
        if "lm_head.weight" in hf and args.tie_word_embeddings:
            emb = hf.get("model.embed_tokens.weight")
            if emb is not None and not torch.equal(hf["lm_head.weight"], emb):
                raise WeightMappingError("tie_word_embeddings=True but lm_head.weight differs from "
                                         "model.embed_tokens.weight")
            out.add("lm_head.weight")
        return out
