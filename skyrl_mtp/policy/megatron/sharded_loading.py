"""Load one tensor-parallel rank's Megatron weights from HF safetensors without reading the whole checkpoint.

The checkpoint's headers are read first (names, shapes: no tensor data) so a mismatch between the
checkpoint and the model fails before any distributed or model set-up. Then, per Megatron parameter,
the family's ``WeightRule`` says which HF tensors it is made of and along which dimension a TP rank
reads its contiguous chunk (``shard_dims``); ``safe_open(...).get_slice(name)`` reads only that chunk
from the memory-mapped file, and ``rule.to_megatron`` turns the chunks into the rank's shard. Peak extra
host memory is one parameter's chunks, not the state dict.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from skyrl_mtp.models.families.base import WeightMappingError
from skyrl_mtp.models.families.packed_experts import PackedExperts
from skyrl_mtp.policy.megatron.hf_bridge import mapped_tensors


class LazyHFCheckpoint(Mapping):
    """Name -> tensor view of an HF safetensors checkpoint that reads tensor data only on demand.

    ``chunk(name, dim, rank, size)`` reads just rank ``rank``'s contiguous chunk along ``dim``;
    ``self[name]`` reads a whole tensor (used only for rare checks such as tied embeddings). Routed experts the
    checkpoint stores packed (packed_experts.py) appear under their per-expert names, each read as its slice.
    """

    def __init__(self, hf_dir: str | Path):
        files = sorted(Path(hf_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in HF checkpoint {str(hf_dir)!r}")
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        stored: dict[str, int] = {}
        for i, h in enumerate(self._handles):
            for k in h.keys():
                if k in stored:
                    raise WeightMappingError(f"tensor {k!r} appears in two safetensors files of {str(hf_dir)!r}")
                stored[k] = i
        self._stored = stored
        # experts stored packed are seen (and read) one expert at a time, as the weight rules name them
        self.packed = PackedExperts({k: tuple(self._slice(k).get_shape()) for k in stored})
        self._names = list(self.packed.view_shapes(dict.fromkeys(stored, ()))) if self.packed else list(stored)

    def _slice(self, name: str):
        return self._handles[self._stored[name]].get_slice(name)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.packed.views:
            return self.packed.read(name, self._slice)
        if name not in self:
            raise KeyError(name)
        return self._handles[self._stored[name]].get_tensor(name)

    def __contains__(self, name) -> bool:
        return name in self.packed.views or (name in self._stored and name not in self.packed.packed)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.packed.views:
            return self.packed.views[name].shape
        return tuple(self._slice(name).get_shape())

    def chunk(self, name: str, dim: int | None, rank: int, size: int) -> torch.Tensor:
        if name in self.packed.views:
            if dim is not None and size > 1:
                raise WeightMappingError(f"{name}: a packed expert's view is read whole (expert tensor parallel 1)")
            return self[name]
        sl = self._slice(name)
        if dim is None or size == 1:
            return sl[:]
        shape = sl.get_shape()
        if shape[dim] % size:
            raise WeightMappingError(f"{name}: dim {dim} of shape {tuple(shape)} is not divisible by tp={size}")
        n = shape[dim] // size
        index = tuple(slice(rank * n, (rank + 1) * n) if d == dim else slice(None) for d in range(len(shape)))
        return sl[index]


def check_checkpoint(ckpt: LazyHFCheckpoint, args, mtp_layers: int, *, transformer_engine: bool | None = None) -> dict:
    """The family's weight rules (for the layer spec ``transformer_engine`` chooses), after checking the checkpoint
    has exactly the HF tensors they need (plus ones the family may ignore); headers only."""
    rules = args.family.weight_rules(args, mtp_layers, transformer_engine=transformer_engine)
    needed = {n for r in rules.values() for n in r.hf_names}
    missing = sorted(needed - ckpt.keys())
    ignorable = args.family.ignorable_hf_names(args, mtp_layers, ckpt) - needed
    extra = sorted(ckpt.keys() - needed - ignorable)
    if missing or extra:
        raise WeightMappingError(f"HF weights do not match the model: missing {missing[:20]}"
                                 f"{' ...' if len(missing) > 20 else ''}; unexpected {extra[:20]}"
                                 f"{' ...' if len(extra) > 20 else ''}")
    return rules


def iter_tp_shard(ckpt: LazyHFCheckpoint, rules: dict, *, tp_rank: int, tp_size: int):
    """(Megatron name, this rank's shard) per parameter, reading only the rank's chunks."""
    for mg, rule in rules.items():
        pieces = [ckpt.chunk(n, d, tp_rank, tp_size) for n, d in zip(rule.hf_names, rule.shard_dims)]
        yield mg, rule.to_megatron(pieces, tp_rank, tp_size)


def load_tp_shard_into(model: torch.nn.Module, ckpt: LazyHFCheckpoint, rules: dict, *, tp_rank: int,
                       tp_size: int) -> None:
    """Copy this rank's shard into ``model`` parameter by parameter (strict names and shapes); ``rules`` are
    this rank's (``rules_for_expert_rank`` under expert parallelism)."""
    params = mapped_tensors(model, rules)
    missing, extra = sorted(params.keys() - rules.keys()), sorted(rules.keys() - params.keys())
    if missing or extra:
        raise WeightMappingError(f"model parameters do not match the weight rules: missing {missing}; "
                                 f"unexpected {extra}")
    with torch.no_grad():
        for mg, t in iter_tp_shard(ckpt, rules, tp_rank=tp_rank, tp_size=tp_size):
            p = params[mg]
            if tuple(t.shape) != tuple(p.shape):
                raise WeightMappingError(f"{mg}: mapped shape {tuple(t.shape)} != model shape {tuple(p.shape)}")
            p.copy_(t.to(p.dtype))
