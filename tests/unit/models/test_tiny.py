"""The tiny MiMo checkpoint factory: determinism, config fields, tokenizer, bad specs, oracle agreement in torch."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

from skyrl_mtp.models.tiny import (
    ROPE_THETA,
    TinyModelSpec,
    build_tiny_checkpoint,
    build_weights,
    cached_tiny_checkpoint,
    head_target_agreement,
    main,
)


def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(seed=0))


def _digest(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_same_spec_gives_same_bytes_and_seed_changes_weights(ckpt, tmp_path):
    again = build_tiny_checkpoint(tmp_path / "again", TinyModelSpec(seed=0))
    assert _digest(again) == _digest(ckpt)
    w0 = build_weights(TinyModelSpec(seed=0))
    w1 = build_weights(TinyModelSpec(seed=1))
    assert set(w0) == set(w1)
    assert not torch.equal(w0["model.embed_tokens.weight"], w1["model.embed_tokens.weight"])


def test_config_fields_and_weight_names(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["MiMoForCausalLM"] and cfg["model_type"] == "qwen2"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["num_nextn_predict_layers"]) == (128, 2, 4, 2, 512, 1)
    assert cfg["head_dim"] == 32 and cfg["tie_word_embeddings"] is False
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]
    w = load_file(str(ckpt / "model.safetensors"))
    assert w["model.mtp_layers.0.input_proj.weight"].shape == (128, 256)
    for name in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        assert w[f"model.mtp_layers.0.{name}.weight"].shape == (128,)
    assert w["lm_head.weight"].shape == (512, 128)
    assert all(t.dtype == torch.float32 for t in w.values())
    assert not any(n.startswith("model.mtp_layers.1.") for n in w)


def test_no_mtp_layers_and_tied_embeddings(tmp_path):
    w = build_weights(TinyModelSpec(mtp_layers=0, tie_word_embeddings=True))
    assert not any("mtp_layers" in n for n in w) and "lm_head.weight" not in w


def test_tokenizer_round_trip_and_chat_template(ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    assert len(tok) <= 512
    text = "What is 37 + 45? <answer>82</answer>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<answer>") in ids          # tool tokens are single tokens
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


@pytest.mark.parametrize("kwargs,match", [
    ({"hidden": 0}, r"TinyModelSpec.hidden=0 is invalid"),
    ({"vocab": 100}, r"TinyModelSpec.vocab=100 is invalid"),
    ({"heads": 3}, r"TinyModelSpec.heads=3 is invalid; allowed: a divisor of hidden=128"),
    ({"heads": 8}, r"TinyModelSpec.heads=8 is invalid.*head_dim"),          # head_dim 16: vLLM CPU cannot
    ({"kv_heads": 3}, r"TinyModelSpec.kv_heads=3 is invalid"),
    ({"head": "perfect"}, r"TinyModelSpec.head='perfect' is invalid"),
    ({"head": "oracle", "mtp_layers": 0}, r"TinyModelSpec.head='oracle' is invalid"),
    ({"head": "oracle", "tie_word_embeddings": True}, r"TinyModelSpec.head='oracle' is invalid"),
    ({"mtp_layers": -1}, r"TinyModelSpec.mtp_layers=-1 is invalid"),
    ({"partial_agreement": 1.0}, r"TinyModelSpec.partial_agreement=1.0 is invalid"),
    ({"sharpness": 0.0}, r"TinyModelSpec.sharpness=0.0 is invalid; allowed: a number > 0"),
    ({"head": "trigram", "tie_word_embeddings": True}, r"TinyModelSpec.head='trigram' is invalid"),
])
def test_bad_specs_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TinyModelSpec(**kwargs)


def test_cli_rejects_bad_spec(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x"), "--heads", "3"])
    assert "TinyModelSpec.heads=3" in capsys.readouterr().err


def _oracle_forward(w: dict[str, torch.Tensor], spec: TinyModelSpec, tokens: torch.Tensor):
    """Target next-token and MTP draft argmax, the way vLLM's MiMo computes them, for a bigram checkpoint.

    Trunk blocks and the MTP block write nothing (zero o_proj/down_proj), so the target's pre-norm hidden
    at a position is the token embedding, and the MTP layer sees input_proj(cat[hnorm(h), tnorm(e_next)]).
    """
    for name, t in w.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.count_nonzero(t) == 0, name
    emb, lm = w["model.embed_tokens.weight"], w["lm_head.weight"]
    target_next = (_rms(emb[tokens]) * w["model.norm.weight"]) @ lm.T
    p = "model.mtp_layers.0."
    nxt = target_next.argmax(-1)
    x = torch.cat([_rms(emb[tokens]) * w[p + "hidden_layernorm.weight"],
                   _rms(emb[nxt]) * w[p + "token_layernorm.weight"]], dim=-1) @ w[p + "input_proj.weight"].T
    draft = (_rms(x) * w[p + "final_layernorm.weight"]) @ lm.T
    return nxt, target_next.softmax(-1), draft.argmax(-1)


def test_oracle_head_drafts_exactly_the_targets_greedy_next_next_token():
    spec = TinyModelSpec(seed=0, head="oracle")
    w = build_weights(spec)
    tokens = torch.arange(spec.vocab)
    nxt, probs, draft = _oracle_forward(w, spec, tokens)
    assert len(set(nxt.tolist())) == spec.vocab                 # a permutation: no fixed attractor token
    assert torch.equal(draft, nxt[nxt])                          # draft at t == target's choice at t+1
    assert probs.max(-1).values.min() > 0.1                      # sharp but not one-hot: T=1 still explores
    assert head_target_agreement(w["model.embed_tokens.weight"], w["lm_head.weight"], torch.eye(spec.hidden)) == 1


def test_random_and_partial_heads_disagree_as_specified():
    w = build_weights(TinyModelSpec(seed=0, head="partial", partial_agreement=0.5))
    spec = TinyModelSpec(seed=0, head="partial")
    nxt, _, draft = _oracle_forward(w, spec, torch.arange(spec.vocab))
    agree = (draft == nxt[nxt]).float().mean().item()
    assert 0.35 < agree < 0.65, agree


def _neox_rope(x: torch.Tensor, d: int) -> torch.Tensor:
    """x [positions, heads, d] rotated the way vLLM's and Megatron's Qwen2 do (pairs i, i + d/2)."""
    theta = ROPE_THETA ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(len(x), dtype=torch.float64)[:, None] * theta
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., : d // 2].double(), x[..., d // 2:].double()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


@pytest.mark.parametrize("shape", [{}, {"hidden": 128, "heads": 2, "kv_heads": 1, "vocab": 1024}])
def test_trigram_target_attends_to_the_previous_token_and_offers_both_successors(shape):
    spec = TinyModelSpec(seed=0, head="trigram", max_position_embeddings=512, **shape)
    w = build_weights(spec)
    d, heads, kv = spec.head_dim, spec.heads, spec.kv_heads
    p = "model.layers.0.self_attn."
    emb, lm = w["model.embed_tokens.weight"], w["lm_head.weight"]
    toks = torch.randint(10, spec.vocab, (spec.max_position_embeddings,), generator=torch.Generator().manual_seed(1))
    x, n = _rms(emb[toks]), len(toks)
    q = _neox_rope((x @ w[p + "q_proj.weight"].T + w[p + "q_proj.bias"]).view(n, heads, d), d)
    k = _neox_rope((x @ w[p + "k_proj.weight"].T + w[p + "k_proj.bias"]).view(n, kv, d), d)
    k = k.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / d**0.5
    att = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    assert att[:, torch.arange(1, n), torch.arange(n - 1)].min() > 1 - 1e-6    # every position, every head

    v = (x @ w[p + "v_proj.weight"].T).view(n, kv, d).repeat_interleave(heads // kv, 1)
    prev = torch.cat([v[:1], v[:-1]]).reshape(n, heads * d).float() @ w[p + "o_proj.weight"].T
    probs = (_rms(emb[toks] + prev) @ lm.T).softmax(-1)[1:]
    succ = (_rms(emb) @ lm.T).argmax(-1)
    cur, before = probs.gather(1, succ[toks[1:]][:, None]), probs.gather(1, succ[toks[:-1]][:, None])
    top2 = probs.topk(2, -1).indices
    assert all(set(t.tolist()) == {int(succ[b]), int(succ[a])}
               for t, a, b in zip(top2, toks[:-1], toks[1:]) if a != b)
    assert 0.25 < cur.mean() < 0.5 and 0.2 < before.mean() < 0.5       # two candidates of similar weight
    for name, t in w.items():                                           # nothing else writes anything
        if name.startswith("model.layers.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            assert (torch.count_nonzero(t) == 0) == (not name.startswith(p[:-10] + "self_attn.o_proj")), name


def test_cached_checkpoint_builds_once(tmp_path):
    spec = TinyModelSpec(seed=3)
    a = cached_tiny_checkpoint(tmp_path, spec)
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    b = cached_tiny_checkpoint(tmp_path, spec)
    assert a == b and (b / "COMPLETE").exists() and (b / "model.safetensors").stat().st_mtime_ns == stamp
