"""The policy's core attention on ``torch.nn.functional.scaled_dot_product_attention`` (``megatron.layer_impl=sdpa``).

Megatron-core without Transformer Engine has only its local ``DotProductAttention``: it writes every [S, S] score of
every head into a global buffer, converts them to fp32, keeps the fp32 softmax and a bf16 copy for backward
(megatron/core/transformer/dot_product_attention.py, fusions/fused_softmax.py ``forward_torch_softmax``). This module
is the same core attention computed by torch's SDPA: on CUDA torch picks a flash / cuDNN / memory-efficient kernel
that never materialises the scores; on the CPU it runs torch's math or flash-CPU kernel (the CPU tests compare it with
the local attention in fp32).

What it takes from Megatron is unchanged: ``query`` [sq, b, heads, d], ``key`` / ``value`` [sk, b, groups, d(v)], the
mask as Megatron passes it (None: causal by the layer's ``attn_mask_type``; else a bool tensor, True = masked: the
dense [b, 1, s, s] mask of packed rows, policy/batch_layout.py). It returns [sq, b, heads * dv] like the local module.
Grouped-query attention goes through SDPA's ``enable_gqa`` (torch's flash and math kernels take it; a masked call
repeats k and v instead, so torch can take its memory-efficient kernel, which accepts a mask but not ``enable_gqa``).
It has no parameters: weight names and checkpoints are the local spec's.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from skyrl_mtp.models.families.base import ModelBuildError

KEY = "megatron.layer_impl"


def _refuse(what: str) -> ModelBuildError:
    return ModelBuildError(f"{KEY}='sdpa' is invalid for this model: {what}; allowed: local, transformer_engine")


@functools.cache
def sdpa_core_attention(base: type | None = None) -> type:
    """A core-attention class that is ``base`` (megatron-core's local ``DotProductAttention`` when None; the MLA
    wrapper of megatron_no_te.py for MLA families) with its forward computed by SDPA. The base's constructor runs
    unchanged, so the softmax scale (1/sqrt(d), or what MLA passes), the heads per TP rank and the config checks are
    Megatron's own."""
    if base is None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        base = DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPACoreAttention(base):
        """``base`` with torch's scaled_dot_product_attention as its forward (see the module docstring)."""

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            for name in ("softmax_scale", "attn_mask_type", "num_attention_heads_per_partition"):
                if not hasattr(self, name):
                    raise ModelBuildError(f"megatron-core's {base.__name__} no longer sets self.{name}: "
                                          "models/families/sdpa_attention.py must be updated")
            if getattr(config, "softmax_type", "vanilla") != "vanilla":
                raise _refuse(f"softmax_type={config.softmax_type!r} (an offset softmax; SDPA has none)")
            if getattr(config, "window_size", None) is not None:
                raise _refuse(f"window_size={config.window_size} (sliding-window attention)")
            if float(self.attention_dropout.p) != 0.0:
                raise _refuse(f"attention_dropout={self.attention_dropout.p} (the policy trains without dropout)")
            # the local module divides the scale by the layer number and its softmax multiplies it back
            coeff = self.layer_number if getattr(config, "apply_query_key_layer_scaling", False) else 1
            self.sdpa_scale = float(self.softmax_scale) * coeff

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            if packed_seq_params is not None:
                raise ModelBuildError("packed_seq_params reached the SDPA core attention: packed rows are passed "
                                      "as a dense mask (policy/batch_layout.py packed_mask)")
            if attention_bias is not None:
                raise ModelBuildError("attention_bias reached the SDPA core attention, which takes none")
            sq, b, heads, _ = query.shape
            sk, _, groups, dv = value.shape
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))   # [b, heads or groups, s, d]
            kind = self.attn_mask_type if attn_mask_type is None else attn_mask_type
            if attention_mask is None:
                causal = kind == AttnMaskType.causal
                if causal and sq != sk:
                    raise ModelBuildError(f"causal SDPA attention needs as many queries as keys, got {sq} and {sk}")
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.sdpa_scale,
                                                     enable_gqa=heads != groups)
            else:
                if heads != groups:
                    k = k.repeat_interleave(heads // groups, dim=1)
                    v = v.repeat_interleave(heads // groups, dim=1)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask.to(torch.bool),
                                                     scale=self.sdpa_scale)
            return out.permute(2, 0, 1, 3).reshape(sq, b, heads * dv)

    SDPACoreAttention.__qualname__ = SDPACoreAttention.__name__ = f"SDPA{base.__name__}"
    return SDPACoreAttention


def check_sdpa_usable(device: torch.device | str = "cpu") -> None:
    """That this node's torch runs SDPA as the core attention calls it (keyword ``scale``, ``enable_gqa``, a bool
    mask), on ``device``: a tiny call; raises naming megatron.layer_impl otherwise."""
    try:
        q = torch.zeros(1, 2, 3, 8, device=device)
        kv = torch.zeros(1, 1, 3, 8, device=device)
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True, scale=0.5, enable_gqa=True)
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(1, 1, 3, 3, dtype=torch.bool, device=device))
    except (TypeError, RuntimeError) as e:
        raise ModelBuildError(f"{KEY}='sdpa' is invalid on this node: torch {torch.__version__}'s "
                              f"scaled_dot_product_attention failed ({e}); allowed: local, or torch >= 2.5 on the "
                              "policy nodes") from None
