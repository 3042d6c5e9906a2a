"""Exact HF <-> megatron-core weight mapping (trunk and MTP layers) through the checkpoint's model family.

The family (``args.family``) says, per Megatron parameter, which HF tensors it is made of and how
(``WeightRule``: hf_names, shard_dims, to_megatron, to_hf); this module applies those rules to whole
state dicts with strict key and shape checks. Under tensor parallelism ``hf_to_megatron`` returns one
rank's shard and ``megatron_to_hf`` takes the list of every rank's shards; under expert parallelism a
rank's shard holds only its experts (``rules_for_expert_rank``) and ``megatron_to_hf`` takes every
(expert-parallel rank, tensor-parallel rank)'s shard.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from skyrl_mtp.models.families.base import WeightMappingError, WeightRule, chunk, rules_for_expert_rank

__all__ = ["WeightMappingError", "hf_to_megatron", "load_hf_weights", "load_into_model", "mapped_tensors", "megatron_to_hf",
           "model_params", "name_map", "weight_rules"]


def weight_rules(args, mtp_layers: int) -> dict[str, WeightRule]:
    """Megatron parameter name -> its WeightRule, for the family of ``args``."""
    return args.family.weight_rules(args, mtp_layers)


def name_map(args, mtp_layers: int) -> dict[str, tuple[str, ...]]:
    """Megatron parameter name -> the HF tensor names it is built from."""
    return {mg: rule.hf_names for mg, rule in weight_rules(args, mtp_layers).items()}


def _check_keys(hf: dict[str, torch.Tensor], needed: set[str], args, mtp_layers: int) -> None:
    missing = sorted(needed - hf.keys())
    ignorable = args.family.ignorable_hf_names(args, mtp_layers, hf) - needed
    extra = sorted(hf.keys() - needed - ignorable)
    if missing or extra:
        raise WeightMappingError(f"HF weights do not match the model: missing {missing[:20]}"
                                 f"{' ...' if len(missing) > 20 else ''}; unexpected {extra[:20]}"
                                 f"{' ...' if len(extra) > 20 else ''}")


def hf_to_megatron(hf: dict[str, torch.Tensor], args, mtp_layers: int, *,
                   tp_rank: int = 0, tp_size: int = 1, ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """One (TP, EP) rank's Megatron parameters from a full HF state dict (strict: missing/extra -> error)."""
    rules = weight_rules(args, mtp_layers)
    _check_keys(hf, {n for r in rules.values() for n in r.hf_names}, args, mtp_layers)
    rules = rules_for_expert_rank(rules, ep_rank, ep_size)
    out = {}
    for mg, rule in rules.items():
        pieces = [chunk(hf[n], d, tp_rank, tp_size, n) for n, d in zip(rule.hf_names, rule.shard_dims)]
        out[mg] = rule.to_megatron(pieces, tp_rank, tp_size).clone()
    return out


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], args, mtp_layers: int, *,
                   ep_size: int = 1) -> dict[str, torch.Tensor]:
    """Full HF state dict from every rank's Megatron parameters: index ep_rank * tp_size + tp_rank."""
    if len(shards) % ep_size:
        raise WeightMappingError(f"{len(shards)} shards do not split into ep={ep_size} expert-parallel ranks")
    tp_size = len(shards) // ep_size
    rules = weight_rules(args, mtp_layers)
    local = [rules_for_expert_rank(rules, e, ep_size) for e in range(ep_size)]
    global_name = {id(r): g for g, r in rules.items()}
    owner: dict[str, tuple[int, str]] = {}   # global name -> (first ep rank holding it, its local name there)
    for e, rank_rules in enumerate(local):
        for name, rule in rank_rules.items():
            owner.setdefault(global_name[id(rule)], (e, name))
    for i, sd in enumerate(shards):
        want = local[i // tp_size].keys()
        missing, extra = sorted(want - sd.keys()), sorted(sd.keys() - want)
        if missing or extra:
            raise WeightMappingError(f"Megatron weights of rank {i} (ep {i // tp_size}, tp {i % tp_size}) do not match: "
                                     f"missing {missing}; unexpected {extra}")
    out = {}
    for mg, rule in rules.items():
        e, name = owner[mg]
        res = rule.to_hf([shards[e * tp_size + t][name].detach().cpu() for t in range(tp_size)])
        for n, t in zip(rule.hf_names, res):
            out[n] = t.contiguous().clone()
    return out


def mapped_tensors(model: torch.nn.Module, names) -> dict[str, torch.Tensor]:
    """The model's parameters, plus those of its buffers that ``names`` (weight-rule keys) map: a router's
    expert bias is a buffer in megatron-core and a tensor of the HF checkpoint."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    out.update({n: buffers[n] for n in names if n not in out and n in buffers})
    return out


def load_into_model(model: torch.nn.Module, mg_sd: dict[str, torch.Tensor]) -> None:
    """Copy a Megatron-named state dict into the model's parameters and mapped buffers (strict, shape-checked)."""
    params = mapped_tensors(model, mg_sd)
    missing, extra = sorted(params.keys() - mg_sd.keys()), sorted(mg_sd.keys() - params.keys())
    if missing or extra:
        raise WeightMappingError(f"model parameters do not match the mapped weights: missing {missing}; unexpected {extra}")
    with torch.no_grad():
        for n, p in params.items():
            src = mg_sd[n]
            if tuple(src.shape) != tuple(p.shape):
                raise WeightMappingError(f"{n}: mapped shape {tuple(src.shape)} != model shape {tuple(p.shape)}")
            p.copy_(src.to(p.dtype))


def model_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def load_hf_weights(hf_path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint, experts stored packed split into per-expert ones (packed_experts.py)."""
    files = sorted(Path(hf_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in HF checkpoint {str(hf_path)!r}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    from skyrl_mtp.models.families.packed_experts import PackedExperts

    packed = PackedExperts({k: tuple(t.shape) for k, t in out.items()})
    return packed.unpack(out) if packed else out
