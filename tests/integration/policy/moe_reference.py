"""Reference computations for the MoE family tests, built from transformers' own modules on the HF weights.

transformers 5 keeps a MoE layer's routed experts as stacked ``experts.gate_up_proj`` [E, 2I, H] and
``experts.down_proj`` [E, H, I] tensors; HF checkpoints (and vLLM) keep one tensor per expert.
``fuse_experts`` turns the second layout into the first.
"""

import torch


def fuse_experts(sd: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    out = dict(sd)
    first = "experts.0.gate_proj.weight"
    prefixes = {k[: -len(first) + len("experts.")] for k in sd if k.endswith(first)}
    for p in prefixes:
        out[p + "gate_up_proj"] = torch.stack([torch.cat([out.pop(f"{p}{e}.gate_proj.weight"),
                                                          out.pop(f"{p}{e}.up_proj.weight")]) for e in range(num_experts)])
        out[p + "down_proj"] = torch.stack([out.pop(f"{p}{e}.down_proj.weight") for e in range(num_experts)])
    return out


def strip_prefix(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
