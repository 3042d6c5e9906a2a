"""The DFlash drafter on plain tensors: its config and refusals, shapes, checkpoint names, export round trip and
checks, and the training form (many anchors in one pass) equal to vLLM's one-proposal form block by block."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from skyrl_mtp.drafters.dflash import (
    DFlashConfig,
    DFlashDrafter,
    block_hidden,
    block_labels,
    default_target_layer_ids,
    propose,
)
from skyrl_mtp.drafters.dflash_export import check_dflash_export, export_dflash, is_dflash_tensor, load_dflash
from skyrl_mtp.drafters.greedy_acceptance import accepted_lengths, dflash_greedy_drafts
from skyrl_mtp.errors import ConfigError

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 100, "max_position_embeddings": 2048}
LAYER_NAMES = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
               "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
               "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
               "mlp.down_proj.weight"}


def drafter(num_layers=2, block_size=4, seed=0) -> DFlashDrafter:
    cfg = DFlashConfig.from_target(QWEN3, num_layers=num_layers, block_size=block_size)
    d = DFlashDrafter(cfg, torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():   # norm scales off 1 and weights past the small init, so mix-ups show
        for name, p in d.named_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g)) if "norm" in name else p.mul_(5.0)
    return d


def inputs(d: DFlashDrafter, batch=2, length=24, seed=3):
    g = torch.Generator().manual_seed(seed)
    cfg = d.cfg
    aux = torch.randn(batch, length, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size - 1, (batch, length), generator=g)
    embed = 0.5 * torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    return aux, ids, embed


def test_config_from_target_and_defaults():
    cfg = DFlashConfig.from_target(QWEN3, num_layers=3, block_size=8)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.vocab_size, cfg.target_num_layers) == (64, 96, 4, 2, 16, 100, 6)
    assert cfg.rope_theta == 1e6 and cfg.rms_norm_eps == 1e-6
    assert cfg.target_layer_ids == (1, 2, 3)      # evenly over 1..n-3
    assert cfg.mask_token_id == 99 and cfg.num_speculative_tokens == 7
    assert DFlashConfig.from_target(QWEN3).target_layer_ids == (3,)
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)   # the published drafters' choice
    assert default_target_layer_ids(4, 2) == (0, 3)                 # tiny: distinct ids over 0..n-1
    assert default_target_layer_ids(2, 3) == (0, 1)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"target_layer_ids": (1, 6)}, "target_layer_ids"),
    ({"target_layer_ids": (2, 2)}, "target_layer_ids"),
    ({"target_layer_ids": ()}, "target_layer_ids"),
    ({"block_size": 1}, "block_size"),
    ({"mask_token_id": 100}, "mask_token_id"),
    ({"num_layers": 0}, "num_layers"),
])
def test_config_refusals_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=rf"DFlashConfig\.{field}="):
        DFlashConfig.from_target(QWEN3, **kwargs)


def test_config_refuses_bad_shapes_and_missing_target_fields():
    with pytest.raises(ConfigError, match=r"DFlashConfig\.num_key_value_heads=3"):
        DFlashConfig.from_target({**QWEN3, "num_key_value_heads": 3})
    with pytest.raises(ConfigError, match=r"missing \['vocab_size'\]"):
        DFlashConfig.from_target({k: v for k, v in QWEN3.items() if k != "vocab_size"})


def test_shapes_names_and_seeded_init():
    d = drafter(num_layers=2)
    names = set(d.state_dict())
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{n}" for i in (0, 1) for n in LAYER_NAMES}
    assert names == want
    assert all(is_dflash_tensor(n) for n in names)
    assert not any(is_dflash_tensor(n) for n in ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight",
                                                "model.embed_tokens.weight", "model.norm.weight"))
    assert d.fc.weight.shape == (64, 64 * len(d.cfg.target_layer_ids))
    a = DFlashDrafter(d.cfg, torch.Generator().manual_seed(5)).state_dict()
    b = DFlashDrafter(d.cfg, torch.Generator().manual_seed(5)).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert float(a["norm.weight"].min()) == 1.0 and 0.015 < float(a["fc.weight"].std()) < 0.025
    aux, ids, embed = inputs(d)
    out = block_hidden(d, aux, ids, embed, torch.tensor([[1, 7, 20], [2, 3, 23]]))
    assert out.shape == (2, 3, 4, 64)
    with pytest.raises(ValueError, match="anchors must lie in"):
        block_hidden(d, aux, ids, embed, torch.tensor([[0, 7, 20], [2, 3, 23]]))
    with pytest.raises(ValueError, match="expected 128"):
        d.context(aux[..., :64])


def test_training_form_equals_one_proposal_per_anchor():
    d = drafter(num_layers=2, block_size=5)
    aux, ids, embed = inputs(d)
    anchors = torch.tensor([[1, 6, 13, 23], [2, 9, 10, 17]])
    with torch.no_grad():
        out = block_hidden(d, aux, ids, embed, anchors)
        worst = 0.0
        for b in range(2):
            for n, a in enumerate(anchors[b].tolist()):
                one = propose(d, aux[b:b + 1, :a], torch.arange(a)[None], ids[b, a:a + 1], torch.tensor([a]), embed, 4)
                worst = max(worst, float((one[0] - out[b, n]).abs().max()))
    assert worst < 1e-5, worst
    assert float(out.abs().mean()) > 0.1
    # the mask slots differ from each other (RoPE positions inside the non-causal block)
    assert float((out[:, :, 1] - out[:, :, 2]).abs().max()) > 1e-3


def test_training_form_on_packed_sequences_and_offset_positions():
    d = drafter(num_layers=1, block_size=3)
    aux, ids, embed = inputs(d, batch=1, length=20)
    segments = torch.tensor([[0] * 8 + [1] * 12])
    positions = torch.cat([torch.arange(8), torch.arange(12)])[None] + 30
    anchors = torch.tensor([[3, 10, 15]])
    with torch.no_grad():
        out = block_hidden(d, aux, ids, embed, anchors, positions=positions, segment_ids=segments)
        for n, a in enumerate(anchors[0].tolist()):
            start = 0 if a < 8 else 8
            one = propose(d, aux[:, start:a], positions[:, start:a], ids[0, a:a + 1], positions[0, a:a + 1], embed, 2)
            assert float((one[0] - out[0, n]).abs().max()) < 1e-5
    labels = block_labels(ids, anchors, 3, segments)
    assert labels[0, 0].tolist() == ids[0, 4:6].tolist()
    assert labels[0, 2].tolist() == ids[0, 16:18].tolist()
    assert block_labels(ids, torch.tensor([[6, 19]]), 3, segments).tolist() == [[[ids[0, 7].item(), -100],
                                                                                  [-100, -100]]]


def test_training_form_trains_every_tensor():
    d = drafter(num_layers=2)
    aux, ids, embed = inputs(d)
    anchors = torch.tensor([[1, 5, 9], [4, 11, 20]])
    hidden = block_hidden(d, aux, ids, embed, anchors)
    lm_head = 0.2 * torch.randn(100, 64, generator=torch.Generator().manual_seed(9))
    logits = F.linear(hidden[:, :, 1:], lm_head)
    labels = block_labels(ids, anchors, d.cfg.block_size)
    F.cross_entropy(logits.reshape(-1, 100), labels.reshape(-1), ignore_index=-100).backward()
    assert all(p.grad is not None and float(p.grad.abs().max()) > 0 for p in d.parameters())


def test_greedy_drafts_are_the_per_index_proposals():
    d = drafter(num_layers=2)
    aux, ids, embed = inputs(d, batch=1, length=12)
    lm_head = 0.2 * torch.randn(100, 64, generator=torch.Generator().manual_seed(9))
    drafts = dflash_greedy_drafts(d, aux, ids, embed, lm_head, k=3)
    assert drafts.shape == (1, 12, 3) and drafts[0, 11].tolist() == [-1, -1, -1]
    for t in (0, 5, 10):
        with torch.no_grad():
            one = propose(d, aux[:, :t + 1], torch.arange(t + 1)[None], ids[0, t + 1:t + 2], torch.tensor([t + 1]),
                          embed, 3)
        assert drafts[0, t].tolist() == F.linear(one[0, 1:], lm_head).argmax(-1).tolist()
    # a sequence that IS the drafts from index 4 accepts all three there
    seq = ids.clone()
    seq[0, 6:9] = drafts[0, 4]
    again = dflash_greedy_drafts(d, aux, seq, embed, lm_head, k=3)
    assert accepted_lengths(again, seq)[0, 4] == 3


def test_export_round_trip_and_checks(tmp_path):
    d = drafter(num_layers=2, block_size=6)
    out = export_dflash(d, d.cfg, tmp_path / "dflash")
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["architectures"] == ["DFlashDraftModel"] and cfg_json["model_type"] == "qwen3"
    assert cfg_json["dflash_config"] == {"mask_token_id": 99, "target_layer_ids": list(d.cfg.target_layer_ids)}
    assert cfg_json["num_hidden_layers"] == 2 and cfg_json["block_size"] == 6
    assert set(load_file(str(out / "model.safetensors"))) == set(d.state_dict())
    loaded, cfg = load_dflash(out)
    assert cfg == d.cfg
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in d.state_dict().items())
    check_dflash_export(out, QWEN3)
    with pytest.raises(ValueError, match=r"architectures \['MiMoForCausalLM'\] emit no auxiliary"):
        check_dflash_export(out, {**QWEN3, "architectures": ["MiMoForCausalLM"]})
    with pytest.raises(ValueError, match="hidden_size=64 differs from the target's 128"):
        check_dflash_export(out, {**QWEN3, "hidden_size": 128})
    with pytest.raises(ValueError, match=r"target_layer_ids=\[1, 3\]; allowed: distinct 0-based ids in 0\.\.1"):
        check_dflash_export(out, {**QWEN3, "num_hidden_layers": 2})
    bad = dict(cfg_json, dflash_config={**cfg_json["dflash_config"], "mask_token_id": 100})
    (out / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"mask_token_id=100; allowed: a token id in \[0, 100\)"):
        check_dflash_export(out, QWEN3)
    (out / "config.json").write_text(json.dumps(dict(cfg_json, dflash_config={**cfg_json["dflash_config"],
                                                                              "causal": True})))
    with pytest.raises(ValueError, match="sets causal"):
        check_dflash_export(out, QWEN3)


def test_a_published_drafters_config_without_our_key_loads_with_the_targets_layer_count(tmp_path):
    """A DFlash checkpoint in vLLM's layout that was not written here names no target layer count of ours."""

    from skyrl_mtp.drafters.dflash import DFlashConfig, DFlashDrafter
    from skyrl_mtp.drafters.dflash_export import OWN_KEY, export_dflash, load_dflash

    target = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 128, "max_position_embeddings": 256}
    cfg = DFlashConfig.from_target(target, num_layers=2, block_size=4)
    out = export_dflash(DFlashDrafter(cfg, torch.Generator().manual_seed(0)), cfg, tmp_path / "d")
    published = json.loads((out / "config.json").read_text())
    del published[OWN_KEY]
    (out / "config.json").write_text(json.dumps(published))
    _, loaded = load_dflash(out, target_num_layers=4)
    assert loaded == cfg
