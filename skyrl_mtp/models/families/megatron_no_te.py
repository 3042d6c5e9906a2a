"""What megatron-core 0.16.x / 0.19.x need to build MLA and MoE layers from local specs (no Transformer Engine).

Without Transformer Engine megatron-core's ``extensions/transformer_engine.py`` still imports: it binds
``TELinear``, ``TEColumnParallelLinear``, ... to ``MagicMock`` stand-ins. Two modules are fooled by them:
- ``transformer/multi_latent_attention.py`` sets ``HAVE_TE = True`` (the import succeeded) and then asks
  ``isinstance(self.linear_proj, TELinear)``, which fails on a MagicMock: ``HAVE_TE`` must be False there;
- ``transformer/moe/moe_utils.py`` fails the import (no TE router kernels), so its ``te_general_gemm`` is never
  bound, yet the router's gating GEMM asks ``te_general_gemm is not None``: it must be None.
``fix_megatron_without_te`` makes both corrections only when Transformer Engine is really absent, after
checking that the names it corrects are still used the way it expects (it raises otherwise).

The local ``DotProductAttention`` does not take the ``k_channels`` / ``v_channels`` keyword arguments MLA
builds its core attention with; ``MLACoreAttention`` (the core-attention module of the MLA families'
local specs) drops them after checking they equal what the local module derives from the config.
"""

from __future__ import annotations

import importlib.util
import inspect

from skyrl_mtp.models.families.base import ModelBuildError

_FIXED: list[str] = []


def transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _source(module) -> str:
    return inspect.getsource(module)


def fix_megatron_without_te() -> list[str]:
    """Apply the two corrections (idempotent); returns what was corrected (nothing when TE is installed)."""
    if _FIXED or transformer_engine_installed():
        return list(_FIXED)
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla

    problems = []
    if not hasattr(mla, "HAVE_TE") or "isinstance(self.linear_proj, TELinear)" not in _source(mla):
        problems.append("multi_latent_attention.HAVE_TE / its isinstance(self.linear_proj, TELinear) check")
    if "te_general_gemm is not None" not in _source(moe_utils) or getattr(moe_utils, "HAVE_TE", None) is not False:
        problems.append("moe_utils' `te_general_gemm is not None` check behind a failed TE import (HAVE_TE=False)")
    if problems:
        raise ModelBuildError(f"megatron-core changed where skyrl_mtp corrects its no-Transformer-Engine MLA/MoE path: "
                              f"{problems}; update models/families/megatron_no_te.py")
    mla.HAVE_TE = False
    _FIXED.append("multi_latent_attention.HAVE_TE=False")
    if getattr(moe_utils, "te_general_gemm", None) is not None:
        raise ModelBuildError("moe_utils.te_general_gemm is bound although Transformer Engine is not installed; "
                              "update models/families/megatron_no_te.py")
    moe_utils.te_general_gemm = None
    _FIXED.append("moe_utils.te_general_gemm=None")
    return list(_FIXED)


def mla_core_attention():
    """The local core attention for MLA (a subclass of megatron-core's ``DotProductAttention``)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    params = set(inspect.signature(DotProductAttention.__init__).parameters)
    wanted = {"config", "layer_number", "attn_mask_type", "attention_type", "softmax_scale"}
    if not wanted <= params:
        raise ModelBuildError(f"megatron-core DotProductAttention.__init__ takes {sorted(params)}; MLACoreAttention "
                              f"needs {sorted(wanted)}: update models/families/megatron_no_te.py")
    if {"k_channels", "v_channels"} & params:
        return DotProductAttention  # this release takes them itself

    class MLACoreAttention(DotProductAttention):
        """DotProductAttention built as MLA builds its core attention. The local module reads the value head
        size from ``config.kv_channels`` (the families set it to v_head_dim) and takes the key size from the
        tensors; MLA passes both sizes explicitly (the base ``Attention`` first builds one without them, which
        MLA then replaces), and they are checked here, then dropped."""

        def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
            want_k = config.qk_head_dim + config.qk_pos_emb_head_dim
            given = (k_channels, v_channels) != (None, None)
            if given and ((k_channels, v_channels) != (want_k, config.kv_channels)
                          or config.kv_channels != config.v_head_dim):
                raise ModelBuildError(f"MLACoreAttention: k_channels={k_channels}, v_channels={v_channels} with "
                                      f"kv_channels={config.kv_channels}, v_head_dim={config.v_head_dim}; the local "
                                      f"attention needs v_channels == kv_channels == v_head_dim, k_channels={want_k}")
            super().__init__(config, *args, **kwargs)

    return MLACoreAttention
