"""Exact HF (Qwen2/MiMo) <-> megatron-core weight mapping for the trunk and the MTP layers.

Layout differences handled here:
- Megatron's ``linear_qkv`` stores, per query group, the group's q heads then its k then its v.
- ``linear_fc1`` is ``cat([gate, up])`` (per TP shard).
- MiMo's ``input_proj`` consumes ``cat([hidden, embed])``; Megatron's ``eh_proj`` consumes
  ``cat([embed, hidden])``: the column halves are swapped.
Under tensor parallelism, ``hf_to_megatron`` returns one rank's shard and ``megatron_to_hf`` takes
the list of every rank's shards.
"""

from __future__ import annotations

import torch

from .model_builder import HFModelArgs


class WeightMappingError(KeyError):
    """HF and Megatron weights do not correspond (missing / extra / wrong shape)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


# Megatron suffix -> (HF suffix, kind). Kinds: "copy" (replicated), "col" (dim0 shard),
# "row" (dim1 shard), "qkv_w"/"qkv_b", "fc1".
_BLOCK = {
    "input_layernorm.weight": ("input_layernorm.weight", "copy"),
    "self_attention.linear_qkv.weight": ("self_attn.{q,k,v}_proj.weight", "qkv_w"),
    "self_attention.linear_qkv.bias": ("self_attn.{q,k,v}_proj.bias", "qkv_b"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", "row"),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", "copy"),
    "mlp.linear_fc1.weight": ("mlp.{gate,up}_proj.weight", "fc1"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", "row"),
}


def _block_hf_names(hf_prefix: str, hf_suffix: str) -> list[str]:
    if "{q,k,v}" in hf_suffix:
        return [hf_prefix + hf_suffix.replace("{q,k,v}", x) for x in "qkv"]
    if "{gate,up}" in hf_suffix:
        return [hf_prefix + hf_suffix.replace("{gate,up}", x) for x in ("gate", "up")]
    return [hf_prefix + hf_suffix]


def name_map(args: HFModelArgs, mtp_layers: int) -> dict[str, tuple[list[str], str]]:
    """Megatron param name -> (HF names it is built from, kind)."""
    out: dict[str, tuple[list[str], str]] = {"embedding.word_embeddings.weight": (["model.embed_tokens.weight"], "col")}
    blocks = [(f"decoder.layers.{i}.", f"model.layers.{i}.") for i in range(args.num_layers)]
    blocks += [(f"mtp.layers.{j}.transformer_layer.", f"model.mtp_layers.{j}.") for j in range(mtp_layers)]
    for mg, hf in blocks:
        for mg_suf, (hf_suf, kind) in _BLOCK.items():
            if kind == "qkv_b" and not args.qkv_bias:
                continue
            out[mg + mg_suf] = (_block_hf_names(hf, hf_suf), kind)
    out["decoder.final_layernorm.weight"] = (["model.norm.weight"], "copy")
    for j in range(mtp_layers):
        p, h = f"mtp.layers.{j}.", f"model.mtp_layers.{j}."
        out[p + "enorm.weight"] = ([h + "token_layernorm.weight"], "copy")
        out[p + "hnorm.weight"] = ([h + "hidden_layernorm.weight"], "copy")
        out[p + "eh_proj.weight"] = ([h + "input_proj.weight"], "eh")
        out[p + "final_layernorm.weight"] = ([h + "final_layernorm.weight"], "copy")
    if not args.tie_word_embeddings:
        out["output_layer.weight"] = (["lm_head.weight"], "col")
    return out


def _split(t: torch.Tensor, tp: int, dim: int, what: str) -> list[torch.Tensor]:
    if t.shape[dim] % tp:
        raise WeightMappingError(f"{what}: dim {dim} of shape {tuple(t.shape)} is not divisible by tp={tp}")
    return list(torch.chunk(t, tp, dim=dim))


def _qkv_to_megatron(q, k, v, args: HFModelArgs) -> torch.Tensor:
    g, d = args.num_kv_heads, args.head_dim
    per = args.num_heads // g
    rest = q.shape[1:]
    q = q.reshape(g, per * d, *rest)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(g * (per + 2) * d, *rest)


def _qkv_to_hf(w: torch.Tensor, args: HFModelArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = args.num_kv_heads, args.head_dim
    per = args.num_heads // g
    rest = w.shape[1:]
    w = w.reshape(g, (per + 2) * d, *rest)
    q, k, v = torch.split(w, [per * d, d, d], dim=1)
    return q.reshape(g * per * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)


def _eh_swap(w: torch.Tensor) -> torch.Tensor:
    h = w.shape[1] // 2
    return torch.cat([w[:, h:], w[:, :h]], dim=1)


def _check_keys(hf: dict[str, torch.Tensor], needed: set[str], args: HFModelArgs, mtp_layers: int) -> None:
    missing = sorted(needed - hf.keys())
    ignorable = set()
    for k in hf.keys() - needed:
        if k.startswith("model.mtp_layers."):
            j = int(k.split(".")[2])
            if mtp_layers <= j < args.num_nextn_predict_layers:
                ignorable.add(k)  # MTP layers the checkpoint has but this model does not build
        if k == "lm_head.weight" and args.tie_word_embeddings:
            if not torch.equal(hf[k], hf.get("model.embed_tokens.weight", hf[k] * 0 + 1)):
                raise WeightMappingError("tie_word_embeddings=True but lm_head.weight differs from model.embed_tokens.weight")
            ignorable.add(k)
    extra = sorted(hf.keys() - needed - ignorable)
    if missing or extra:
        raise WeightMappingError(f"HF weights do not match the model: missing {missing[:20]}"
                                 f"{' ...' if len(missing) > 20 else ''}; unexpected {extra[:20]}"
                                 f"{' ...' if len(extra) > 20 else ''}")


def hf_to_megatron(hf: dict[str, torch.Tensor], args: HFModelArgs, mtp_layers: int, *,
                   tp_rank: int = 0, tp_size: int = 1) -> dict[str, torch.Tensor]:
    """One TP rank's Megatron parameters from a full HF state dict (strict: missing/extra -> error)."""
    nm = name_map(args, mtp_layers)
    _check_keys(hf, {n for names, _ in nm.values() for n in names}, args, mtp_layers)
    out = {}
    for mg, (names, kind) in nm.items():
        ts = [hf[n] for n in names]
        if kind == "copy":
            t = ts[0]
        elif kind == "col":
            t = _split(ts[0], tp_size, 0, names[0])[tp_rank]
        elif kind == "row":
            t = _split(ts[0], tp_size, 1, names[0])[tp_rank]
        elif kind in ("qkv_w", "qkv_b"):
            t = _split(_qkv_to_megatron(*ts, args), tp_size, 0, mg)[tp_rank]
        elif kind == "fc1":
            gate, up = (_split(x, tp_size, 0, n)[tp_rank] for x, n in zip(ts, names))
            t = torch.cat([gate, up], dim=0)
        elif kind == "eh":
            t = _split(_eh_swap(ts[0]), tp_size, 0, names[0])[tp_rank]
        else:  # pragma: no cover
            raise AssertionError(kind)
        out[mg] = t.clone()
    return out


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], args: HFModelArgs, mtp_layers: int) -> dict[str, torch.Tensor]:
    """Full HF state dict from every TP rank's Megatron parameters (index = TP rank)."""
    nm = name_map(args, mtp_layers)
    for r, sd in enumerate(shards):
        missing, extra = sorted(nm.keys() - sd.keys()), sorted(sd.keys() - nm.keys())
        if missing or extra:
            raise WeightMappingError(f"Megatron weights of TP rank {r} do not match: missing {missing}; unexpected {extra}")
    out = {}
    for mg, (names, kind) in nm.items():
        parts = [sd[mg].detach().cpu() for sd in shards]
        if kind == "copy":
            res = [parts[0]]
        elif kind == "col":
            res = [torch.cat(parts, 0)]
        elif kind == "row":
            res = [torch.cat(parts, 1)]
        elif kind in ("qkv_w", "qkv_b"):
            res = list(_qkv_to_hf(torch.cat(parts, 0), args))
        elif kind == "fc1":
            halves = [torch.chunk(p, 2, dim=0) for p in parts]
            res = [torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)]
        elif kind == "eh":
            res = [_eh_swap(torch.cat(parts, 0))]
        else:  # pragma: no cover
            raise AssertionError(kind)
        for n, t in zip(names, res):
            out[n] = t.contiguous().clone()
    return out


def load_into_model(model: torch.nn.Module, mg_sd: dict[str, torch.Tensor]) -> None:
    """Copy a Megatron-named state dict into the model's parameters (strict, shape-checked)."""
    params = dict(model.named_parameters())
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
