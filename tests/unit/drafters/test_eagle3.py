"""The EAGLE-3 drafter on plain tensors: its config, shapes, checkpoint names, export round trip, the
test-time-training unroll's attention pattern, and the greedy-acceptance walk vLLM's counters follow."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from skyrl_mtp.drafters.eagle3 import (
    Eagle3Cache,
    Eagle3Config,
    Eagle3Drafter,
    default_aux_layer_ids,
    shift_ids,
    unroll,
)
from skyrl_mtp.drafters.eagle3_export import export_eagle3, load_eagle3
from skyrl_mtp.drafters.greedy_acceptance import accepted_lengths, simulate_greedy_spec_decode
from skyrl_mtp.errors import ConfigError

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 100, "max_position_embeddings": 65536,
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 100, "max_position_embeddings": 2048}
CHECKPOINT_NAMES = {
    "fc.weight", "norm.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight"}


def drafter(hf=LLAMA, seed=0) -> Eagle3Drafter:
    d = Eagle3Drafter(Eagle3Config.from_target(hf), torch.Generator().manual_seed(seed))
    with torch.no_grad():   # norm scales off 1, so a mix-up of norms shows
        for name, p in d.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1)))
    return d


def test_config_from_targets():
    llama = Eagle3Config.from_target(LLAMA)
    assert (llama.hidden_size, llama.intermediate_size, llama.num_attention_heads, llama.num_key_value_heads,
            llama.head_dim, llama.vocab_size, llama.target_num_layers) == (64, 96, 2, 1, 32, 100, 4)
    assert llama.rope_theta == 500000.0 and llama.rope_scaling_factor == 8.0
    assert llama.aux_layer_ids == (1, 2, 3)
    qwen3 = Eagle3Config.from_target(QWEN3, aux_layer_ids=(0, 1, 2))
    assert qwen3.rope_scaling_factor is None and qwen3.rms_norm_eps == 1e-6 and qwen3.aux_layer_ids == (0, 1, 2)


def test_default_aux_layer_ids_are_vllms_or_distinct_for_tiny_models():
    assert default_aux_layer_ids(32) == (2, 16, 29)     # vLLM's (2, n // 2, n - 3)
    assert default_aux_layer_ids(8) == (2, 4, 5)
    assert default_aux_layer_ids(6) == (1, 3, 5)        # vLLM's would be (2, 3, 3): two ids, fc input 2H
    assert default_aux_layer_ids(4) == (1, 2, 3)
    assert default_aux_layer_ids(2) == (0, 1, 2)
    with pytest.raises(ConfigError, match="num_hidden_layers=1"):
        default_aux_layer_ids(1)


@pytest.mark.parametrize("ids", [(1, 1, 2), (2, 1, 3), (0, 1, 5), (-1, 0, 1), (1, 2)])
def test_bad_aux_layer_ids_are_refused_by_name(ids):
    with pytest.raises(ConfigError, match=r"Eagle3Config.aux_layer_ids=.*three distinct layer ids in increasing "
                                          r"order within \[0, 4\]"):
        Eagle3Config.from_target(LLAMA, aux_layer_ids=ids)


def test_other_rope_scaling_is_refused():
    with pytest.raises(ValueError, match="rope_type"):
        Eagle3Config.from_target({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_parameters_are_the_checkpoint_names_vllm_loads_and_nothing_of_the_target():
    d = drafter()
    assert set(d.state_dict()) == CHECKPOINT_NAMES
    sd = d.state_dict()
    assert sd["fc.weight"].shape == (64, 3 * 64)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (2 * 32, 2 * 64)   # q/k/v read embedding + hidden
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (1 * 32, 2 * 64)
    assert sd["midlayer.self_attn.o_proj.weight"].shape == (64, 2 * 32)
    assert sd["midlayer.mlp.gate_proj.weight"].shape == (96, 64)


def test_initialisation_small_normal_norms_one():
    d = Eagle3Drafter(Eagle3Config.from_target(LLAMA), torch.Generator().manual_seed(0))
    for name, p in d.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p))
        else:
            assert abs(float(p.detach().std()) - 0.02) < 0.002 and abs(float(p.detach().mean())) < 0.002
    again = Eagle3Drafter(Eagle3Config.from_target(LLAMA), torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), again.state_dict().values()))


def test_forward_shapes_and_inputs():
    d = drafter()
    b, t, h = 3, 7, 64
    embeds, aux = torch.randn(b, t, h), torch.randn(b, t, 3 * h)
    pos = torch.arange(t).expand(b, t)
    out = d(embeds, aux, pos)
    assert out.hidden.shape == out.next_hidden.shape == (b, t, h)
    # the aux states go through fc; an H-wide hidden state is used as is
    again = d(embeds, d.combine(aux), pos)
    torch.testing.assert_close(again.hidden, out.hidden, rtol=0, atol=0)
    # the drafter's norm turns next_hidden into hidden
    torch.testing.assert_close(d.norm(out.next_hidden), out.hidden, rtol=0, atol=0)
    with pytest.raises(ValueError, match="expected 192 .* or 64"):
        d(embeds, torch.randn(b, t, 2 * h), pos)


def test_export_load_round_trip_is_exact(tmp_path):
    d = drafter()
    cfg = d.cfg
    out = export_eagle3(d, cfg, tmp_path / "e")
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"] and hf["model_type"] == "llama"
    assert hf["num_hidden_layers"] == 1 and hf["vocab_size"] == 100 and hf["hidden_size"] == 64
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert hf["rope_theta"] == 500000.0 and hf["rope_scaling"] == LLAMA["rope_scaling"]
    assert "draft_vocab_size" not in hf and "d2t" not in load_file(str(out / "model.safetensors"))
    assert set(load_file(str(out / "model.safetensors"))) == CHECKPOINT_NAMES
    loaded, cfg2 = load_eagle3(out)
    assert cfg2 == cfg
    for (n1, a), (n2, b) in zip(d.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)
    plain = export_eagle3(drafter(QWEN3), Eagle3Config.from_target(QWEN3), tmp_path / "q")
    assert "rope_scaling" not in json.loads((plain / "config.json").read_text())
    assert load_eagle3(plain)[1] == Eagle3Config.from_target(QWEN3)


def _inputs(b=2, t=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 100, (b, t), generator=g), torch.randn(b, t, 3 * 64, generator=g),
            0.5 * torch.randn(100, 64, generator=g), 0.5 * torch.randn(100, 64, generator=g))


@pytest.mark.parametrize("greedy", [False, True])
def test_unroll_at_index_t_reads_nothing_after_t_but_its_input_tokens(greedy):
    """vLLM drafts from the last verified index t with the context's keys (0..t) and its own drafts' keys: every
    unroll pass at t must be blind to the captured states after t (the keys there come from them); the teacher
    tokens ids[t+1+j] are its inputs, so they stay."""
    d = drafter()
    ids, aux, embed, lm_head = _inputs()
    steps, length = 3, ids.shape[1]
    head = lm_head if greedy else None
    full = unroll(d, aux, ids, embed, steps, greedy_lm_head=head)
    for t in range(length - 1):
        changed = aux.clone()
        changed[:, t + 1:] = torch.randn(changed[:, t + 1:].shape)
        other = unroll(d, changed, ids, embed, steps, greedy_lm_head=head)
        for j in range(steps):
            torch.testing.assert_close(other[j].hidden[:, :t + 1], full[j].hidden[:, :t + 1], rtol=1e-5, atol=1e-6)
            assert not torch.allclose(other[j].hidden[:, t + 1:], full[j].hidden[:, t + 1:])


def test_unroll_feeds_next_hidden_and_shifted_positions():
    """Pass j = the drafter on (embedding of ids[t+1+j], pass j-1's next_hidden, position t + j) with the cache."""
    d = drafter()
    ids, aux, embed, _ = _inputs(b=1, t=6)
    pos = torch.arange(6)[None]
    outs = unroll(d, aux, ids, embed, 2)
    cache = Eagle3Cache()
    first = d(torch.nn.functional.embedding(shift_ids(ids, 1), embed), aux, pos, cache)
    second = d(torch.nn.functional.embedding(shift_ids(ids, 2), embed), first.next_hidden, pos + 1, cache)
    torch.testing.assert_close(outs[0].hidden, first.hidden, rtol=0, atol=0)
    torch.testing.assert_close(outs[1].hidden, second.hidden, rtol=0, atol=0)
    assert len(cache.diagonal_k) == 1 and cache.context_k.shape == (1, 2, 6, 32)   # kv heads expanded to 2


def test_segments_attend_within_themselves():
    """Two sequences packed in one row with segment ids (positions restarting) equal the two run apart."""
    d = drafter()
    ids, aux, embed, _ = _inputs(b=2, t=5)
    e = torch.nn.functional.embedding(ids, embed)
    pos = torch.arange(5).expand(2, 5)
    apart = d(e, aux, pos)
    packed = d(e.reshape(1, 10, 64), aux.reshape(1, 10, -1), pos.reshape(1, 10),
               segment_ids=torch.tensor([[0] * 5 + [1] * 5]))
    torch.testing.assert_close(packed.hidden.reshape(2, 5, 64), apart.hidden, rtol=1e-5, atol=1e-6)


def test_accepted_lengths_count_leading_matches():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    drafts = torch.zeros(1, 6, 2, dtype=torch.long)
    drafts[0, 0] = torch.tensor([12, 13])   # both right
    drafts[0, 1] = torch.tensor([13, 99])   # first right
    drafts[0, 2] = torch.tensor([99, 15])   # second right after a wrong first: counts 0
    drafts[0, 3] = torch.tensor([15, 16])   # the second is past the sequence: wrong
    assert accepted_lengths(drafts, ids).tolist() == [[2, 1, 0, 1, 0, 0]]


def test_simulated_walk_is_vllms_step_accounting():
    # prompt of 3 (last prompt index 2), 6 new tokens, k = 2; accepted length per index
    accepted = torch.tensor([[0, 0, 2, 9, 9, 1, 9, 0, 9, 9, 9, 9]])
    # index 2: 2 accepted (+1 sampled) -> generated 1 + 3 = 4, index 5: 1 accepted -> 6 = max_tokens: stop
    assert simulate_greedy_spec_decode(accepted, 3, 6, 2) == (2, [2, 1])
    # one more token wanted: index 7 drafts once more (both wrong) -> 7 tokens
    assert simulate_greedy_spec_decode(accepted, 3, 7, 2) == (3, [2, 1])
    # max_tokens = 1: the prefill's token is all, no draft
    assert simulate_greedy_spec_decode(accepted, 3, 1, 2) == (0, [0, 0])


def test_transformers_hidden_states_are_vllms_aux_ids_below_n_and_post_norm_at_n():
    """vLLM's aux id L (L < n) = transformers' output_hidden_states[L]; at L = n transformers applies the final
    norm, vLLM does not (the capture must read the norm's input there)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, vocab_size=100)
    model = LlamaForCausalLM(cfg).eval()
    residual = []
    hooks = [layer.register_forward_hook(lambda _m, _a, out: residual.append(out[0] if isinstance(out, tuple)
                                                                                  else out))
             for layer in model.model.layers]
    ids = torch.randint(0, 100, (1, 5))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    torch.testing.assert_close(out.hidden_states[0], model.model.embed_tokens(ids))        # aux id 0
    torch.testing.assert_close(out.hidden_states[1], residual[0])                           # aux id 1
    torch.testing.assert_close(out.hidden_states[2], model.model.norm(residual[1]))         # NOT aux id 2
