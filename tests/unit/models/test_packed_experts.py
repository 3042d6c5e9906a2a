"""Experts a checkpoint stores packed (transformers 5's [E, 2I, H] gate_up_proj / [E, H, I] down_proj) seen one
expert at a time: by the lazy reader (only the view's slice is read), by the weight-sync schema, and written back
packed by the streaming export whatever order the per-expert tensors arrive in."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from skyrl_mtp.models.families.packed_experts import PackedExperts, PackedExpertsError
from skyrl_mtp.policy.megatron.hf_export import write_safetensors_stream
from skyrl_mtp.policy.megatron.sharded_loading import LazyHFCheckpoint
from skyrl_mtp.weight_sync.schema import read_weight_schema

E, INTER, H = 4, 3, 5


def _stored() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(2, H, generator=g),
            "m.layers.0.mlp.experts.gate_up_proj": torch.randn(E, 2 * INTER, H, generator=g),
            "m.layers.0.mlp.experts.down_proj": torch.randn(E, H, INTER, generator=g).to(torch.bfloat16).float(),
            "z.weight": torch.randn(3, generator=g)}


def test_views_name_each_expert_and_read_its_slice(tmp_path):
    sd = _stored()
    packed = PackedExperts({k: tuple(t.shape) for k, t in sd.items()})
    flat = packed.unpack(sd)
    assert list(flat)[0] == "a.weight" and list(flat)[-1] == "z.weight" and len(flat) == 2 + 3 * E
    gu = sd["m.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(flat["m.layers.0.mlp.experts.2.gate_proj.weight"], gu[2, :INTER])
    assert torch.equal(flat["m.layers.0.mlp.experts.2.up_proj.weight"], gu[2, INTER:])
    assert torch.equal(flat["m.layers.0.mlp.experts.3.down_proj.weight"], sd["m.layers.0.mlp.experts.down_proj"][3])
    repacked = packed.pack(flat)
    assert repacked.keys() == sd.keys() and all(torch.equal(repacked[k], sd[k]) for k in sd)

    save_file(sd, str(tmp_path / "model.safetensors"))
    lazy = LazyHFCheckpoint(tmp_path)
    assert sorted(lazy) == sorted(flat) and "m.layers.0.mlp.experts.1.up_proj.weight" in lazy
    assert "m.layers.0.mlp.experts.gate_up_proj" not in lazy
    assert lazy.shape("m.layers.0.mlp.experts.1.up_proj.weight") == (INTER, H)
    assert all(torch.equal(lazy[k], flat[k]) for k in flat)
    assert torch.equal(lazy.chunk("m.layers.0.mlp.experts.0.down_proj.weight", None, 0, 1), flat[
        "m.layers.0.mlp.experts.0.down_proj.weight"])
    schema = read_weight_schema(tmp_path)
    assert schema.keys() == flat.keys() and schema["m.layers.0.mlp.experts.3.gate_proj.weight"].shape == (INTER, H)


def test_the_streaming_export_writes_experts_back_packed_in_any_order(tmp_path):
    sd = _stored()
    packed = PackedExperts({k: tuple(t.shape) for k, t in sd.items()})
    flat = packed.unpack(sd)
    order = sorted(flat, key=lambda n: (n.split(".")[-2], n))   # all down_proj first, experts shuffled by name
    layout = [(n, tuple(flat[n].shape), flat[n].dtype) for n in order]
    write_safetensors_stream(tmp_path / "model.safetensors", layout, ((n, flat[n]) for n in order), packed=packed)
    back = load_file(str(tmp_path / "model.safetensors"))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert list(f.keys()) == sorted(sd)

    with pytest.raises(PackedExpertsError, match="writes 7 of the 8 views"):
        packed.stored_layout([x for x in layout if x[0] != "m.layers.0.mlp.experts.1.up_proj.weight"])
    with pytest.raises(PackedExpertsError, match="both packed and one by one"):
        PackedExperts({"p.experts.gate_up_proj": (1, 2, 2), "p.experts.0.gate_proj.weight": (1, 2)})
    with pytest.raises(PackedExpertsError, match="3-D"):
        PackedExperts({"p.experts.down_proj": (4, 4)})
