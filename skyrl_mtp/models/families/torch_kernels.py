"""Pure-torch pieces the hybrid (Gated DeltaNet) families need where their fused kernels are unavailable.

megatron-core's ``GatedDeltaNet`` imports ``l2norm`` and ``chunk_gated_delta_rule`` from ``fla`` (Triton)
and refuses to build without it; with ``deterministic_mode`` it runs its own pure-torch chunked delta rule
(``torch_chunk_gated_delta_rule``) and needs only ``l2norm``. ``fla`` does not import here (no CUDA, and
its Triton version does not match), so ``enable_torch_gated_delta_net`` supplies the project's ``l2norm``
to Megatron's module. The norms below are the Qwen3.5/Qwen3-Next ones vLLM uses (weights centred on 0).
"""

from __future__ import annotations

import importlib.util

import torch

from skyrl_mtp.models.families.base import ModelBuildError


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` along ``dim`` (fla's l2norm: eps inside the root, not a clamp)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def _gdn_modules(gdn) -> list:
    """The modules whose globals GatedDeltaNet reads ``HAVE_FLA`` / ``l2norm`` from: the module itself on
    megatron-core 0.16.x; on 0.19 a package whose ``common`` submodule defines them (and the base class)."""
    import sys

    homes = [gdn, sys.modules[gdn.torch_chunk_gated_delta_rule.__module__]]
    homes += [sys.modules[c.__module__] for c in gdn.GatedDeltaNet.__mro__ if c.__module__.startswith("megatron.")]
    return [m for m in dict.fromkeys(homes) if hasattr(m, "HAVE_FLA")]


def enable_torch_gated_delta_net() -> bool:
    """Let megatron-core's GatedDeltaNet build without ``fla``; True when it must run in deterministic mode
    (the pure-torch delta rule). Checks that what it patches is still there."""
    import megatron.core.ssm.gated_delta_net as gdn

    missing = [n for n in ("HAVE_FLA", "GatedDeltaNet", "torch_chunk_gated_delta_rule") if not hasattr(gdn, n)]
    if missing:
        raise ModelBuildError(f"megatron.core.ssm.gated_delta_net has no {missing}: this megatron-core version's "
                              "Gated DeltaNet is not one skyrl_mtp supports (0.16.x, 0.19.x); update torch_kernels.py")
    homes = _gdn_modules(gdn)
    if all(m.HAVE_FLA and getattr(m, "l2norm", None) is not l2norm for m in homes):
        return False  # the real fla kernels are importable: Megatron uses them
    for m in homes:
        m.l2norm = l2norm
        m.HAVE_FLA = True
    return True


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class OffsetRMSNorm(torch.nn.Module):
    """RMSNorm whose scale is ``1 + weight`` (weight initialised to 0), computed in float32 like vLLM's
    GemmaRMSNorm. Built by Megatron specs as ``(config=, hidden_size=, eps=)``."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_):
        super().__init__()
        if hidden_size <= 0:
            raise ModelBuildError(f"OffsetRMSNorm hidden_size={hidden_size} must be > 0")
        self.eps = eps
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_rms(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class PlainRMSNorm(torch.nn.Module):
    """RMSNorm with scale ``weight`` (initialised to 1), computed in float32: the Gated DeltaNet output norm."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_):
        super().__init__()
        if hidden_size <= 0:
            raise ModelBuildError(f"PlainRMSNorm hidden_size={hidden_size} must be > 0")
        self.eps = eps
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight.float() * _rms(x, self.eps)).to(x.dtype)
