"""Megatron policy with a decoupled MTP head, on CPU with real megatron-core (one process, TP=1),
on checkpoints of the tiny checkpoint factory."""

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from skyrl_mtp.net import free_port
from skyrl_mtp.policy.batch_layout import BatchError, prepare
from skyrl_mtp.policy.config import PolicyConfigError, PolicyWorkerConfig
from skyrl_mtp.policy.megatron.hf_bridge import WeightMappingError
from skyrl_mtp.policy.megatron.model_builder import ModelBuildError
from skyrl_mtp.policy.megatron_policy import MegatronPolicy, load_hf_weights, reproducible_metrics

pytestmark = pytest.mark.integration
PORT = free_port()
VOCAB = 512  # TinyModelSpec().vocab


def make(ckpt, **kw) -> MegatronPolicy:
    base = dict(policy_lr=1e-3, head_lr=1e-3, micro_batch_size=2, seed=0)
    base.update(kw)
    return MegatronPolicy(PolicyWorkerConfig(**base), str(ckpt), 0, 1, "127.0.0.1", PORT)


def make_batch(seed=0, b=4, s=24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    attn = torch.ones(b, s, dtype=torch.long)
    attn[0, -5:] = 0
    loss_mask = torch.zeros(b, s)
    loss_mask[:, 8:] = 1
    loss_mask[1, 12:15] = 0  # a tool output inside the response
    loss_mask *= attn
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask,
            "old_logprobs": torch.randn(b, s, generator=g) * 0.1 - 6.0,
            "advantages": torch.randn(b, 1, generator=g).expand(b, s).clone()}


def params(p: MegatronPolicy, head: bool) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in p.model.named_parameters() if n.startswith("mtp.") == head}


def grads(p: MegatronPolicy, head: bool) -> dict[str, torch.Tensor | None]:
    return {n: (None if t.grad is None else t.grad.clone()) for n, t in p.model.named_parameters()
            if n.startswith("mtp.") == head}


def close(*pols: MegatronPolicy) -> None:
    for p in pols:
        if p.capture is not None:
            p.capture.remove()


@pytest.fixture(params=["untied", "tied"])
def mtp_ckpt(request, tiny_ckpt, tiny_tied_ckpt):
    return tiny_ckpt if request.param == "untied" else tiny_tied_ckpt


def test_logits_match_transformers_qwen2(tiny_varied_ckpt):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    pol = make(tiny_varied_ckpt)
    cfg = json.loads((tiny_varied_ckpt / "config.json").read_text())
    hf_model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in cfg.items() if k != "architectures"})).eval()
    sd = {k: v for k, v in load_hf_weights(tiny_varied_ckpt).items() if not k.startswith("model.mtp_layers.")}
    missing, unexpected = hf_model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    batch = make_batch()
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(input_ids=batch["input_ids"]).logits.float(), -1)
        pol.model.eval()
        mine = torch.log_softmax(pol._forward(prepare(batch)), -1)
    assert float(ref.std(-1).mean()) > 0.1  # not a flat distribution: the comparison can fail
    torch.testing.assert_close(mine, ref, atol=2e-5, rtol=1e-5)
    ref_lp = torch.zeros(batch["input_ids"].shape)
    ref_lp[:, 1:] = ref[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    torch.testing.assert_close(pol.compute_logprobs(batch), ref_lp, atol=2e-5, rtol=1e-5)
    close(pol)


def test_gradient_isolation_and_metrics(mtp_ckpt):
    pol = make(mtp_ckpt)
    from skyrl_mtp.mtp.draft_head import DraftLossSpec, compute_draft_loss

    batch = prepare(make_batch())
    pol.model.train()
    calls = []
    hook = pol.model.mtp.register_forward_pre_hook(lambda *a: calls.append(1))
    logits = pol._forward(batch)
    hook.remove()
    assert not calls  # the patched forward does not run the MTP block (nor attach Megatron's MTP loss)
    res = compute_draft_loss(pol.model, pol.capture.take(), logits, batch, DraftLossSpec(num_depths=2, depth_decay=1.0),
                             VOCAB)
    assert float(res.num_tokens) > 0 and len(res.per_depth) == 2
    res.loss_sum.backward()
    trunk, head = grads(pol, head=False), grads(pol, head=True)
    assert all(g is None or not g.any() for g in trunk.values()), [n for n, g in trunk.items() if g is not None and g.any()]
    assert len(head) > 10 and all(g is not None and g.abs().sum() > 0 for g in head.values())
    with torch.no_grad():   # trainer.mtp.loss_depth_decay: depth 2 weighs half, in the sum and in the count
        logits = pol._forward(batch)
        half = compute_draft_loss(pol.model, pol.capture.take(), logits, batch,
                                  DraftLossSpec(num_depths=2, depth_decay=0.5), VOCAB)
    (l1, n1, _), (l2, n2, _) = res.per_depth
    assert half.per_depth == res.per_depth and l2 > 0 and n2 > 0
    assert float(res.loss_sum) == pytest.approx(l1 + l2, rel=1e-5) and float(res.num_tokens) == n1 + n2
    assert float(half.loss_sum) == pytest.approx(l1 + 0.5 * l2, rel=1e-5)
    assert float(half.num_tokens) == n1 + 0.5 * n2
    m = pol.train_step(make_batch(1), "dapo", {"eps_clip_low": 0.2, "eps_clip_high": 0.28, "dual_clip_c": 3.0})
    for k in ("policy/loss", "policy/grad_norm", "mtp/loss", "mtp/grad_norm", "mtp/top1_agreement_pos_1",
              "policy/clip_frac_low", "policy/dual_clip_frac"):
        assert k in m and m[k] == m[k], k
    assert not any(k.startswith("policy/policy/") for k in m), sorted(m)
    assert m["mtp/loss"] > 0 and m["mtp/grad_norm"] > 0
    close(pol)


def test_policy_bitwise_identical_with_and_without_mtp(mtp_ckpt):
    on, off = make(mtp_ckpt, mtp_enabled=True), make(mtp_ckpt, mtp_enabled=False)
    assert off.mtp_layers == 0 and on.mtp_layers == 1
    for step in range(5):
        batch = make_batch(10 + step)
        m_on = on.train_step(copy.deepcopy(batch), "dapo", {})
        m_off = off.train_step(copy.deepcopy(batch), "dapo", {})
        assert m_on["policy/grad_norm"] == m_off["policy/grad_norm"]
        assert m_on["policy/loss"] == m_off["policy/loss"]
        g_on, g_off = grads(on, head=False), grads(off, head=False)
        assert g_on.keys() == g_off.keys()
        for n in g_on:  # (clipped) policy gradients of this step
            assert torch.equal(g_on[n], g_off[n]), (step, n)
    s_on, s_off = params(on, head=False), params(off, head=False)
    for n in s_on:
        assert torch.equal(s_on[n], s_off[n]), n
    close(on, off)


def test_save_load_resume_identical(tiny_ckpt, tmp_path):
    a = make(tiny_ckpt, lr_warmup_steps=3, mtp_num_depths=2)
    for i in range(2):
        a.train_step(make_batch(20 + i), "dapo", {})
    a.save_checkpoint(str(tmp_path / "ck"))
    m_a = [a.train_step(make_batch(30 + i), "dapo", {}) for i in range(2)]
    b = make(tiny_ckpt, lr_warmup_steps=3, mtp_num_depths=2)
    b.load_checkpoint(str(tmp_path / "ck"))
    assert b.step == 2
    m_b = [b.train_step(make_batch(30 + i), "dapo", {}) for i in range(2)]
    assert [m.keys() for m in m_a] == [m.keys() for m in m_b]
    assert [reproducible_metrics(m) for m in m_a] == [reproducible_metrics(m) for m in m_b]
    for (n, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), n
    hf = load_file(str(tmp_path / "ck" / "hf" / "model.safetensors"))
    draft = load_file(str(tmp_path / "ck" / "draft_head" / "draft_head.safetensors"))
    assert (tmp_path / "ck" / "draft_head" / "config.json").is_file()
    assert (tmp_path / "ck" / "hf" / "tokenizer.json").is_file()
    assert set(draft) == {k for k in hf if k.startswith("model.mtp_layers.")} and draft
    assert set(hf) == set(load_hf_weights(tiny_ckpt))
    close(a, b)


def test_sft_loss_is_token_mean_nll_and_trains_head(tiny_ckpt):
    pol = make(tiny_ckpt, policy_lr=1e-3)
    batch = make_batch(3)
    sft = {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask")}
    lp = pol.compute_logprobs(sft)
    expected = float(-(lp * sft["loss_mask"]).sum() / sft["loss_mask"].sum())
    head_before = params(pol, head=True)
    m = pol.train_step(sft, "sft")
    assert m["policy/loss"] == pytest.approx(expected, rel=1e-5)
    assert m["mtp/loss"] > 0 and "mtp/top1_agreement_pos_1" in m
    assert any(not torch.equal(t, params(pol, head=True)[n]) for n, t in head_before.items())
    for _ in range(5):
        last = pol.train_step(sft, "sft")
    assert last["policy/loss"] < m["policy/loss"] - 0.5  # the NLL of the batch goes down
    with pytest.raises(ValueError, match=r"policy_loss='sft' takes no policy_loss_kwargs; got \['eps_clip_low'\]"):
        pol.train_step(sft, "sft", {"eps_clip_low": 0.2})
    with pytest.raises(BatchError, match="old_logprobs"):
        pol.train_step(sft, "dapo", {})
    close(pol)


def test_train_head_false_leaves_head_untouched_and_policy_unchanged(tiny_ckpt):
    on, off = make(tiny_ckpt), make(tiny_ckpt, mtp_enabled=False)
    head_before = params(on, head=True)
    for step in range(3):
        batch = make_batch(40 + step)
        m_on = on.train_step(copy.deepcopy(batch), "sft" if step < 2 else "dapo",
                             train_head=False, **({} if step < 2 else {"policy_loss_kwargs": {}}))
        m_off = off.train_step({k: v for k, v in batch.items()}, "sft" if step < 2 else "dapo")
        assert m_on["policy/grad_norm"] == m_off["policy/grad_norm"]
        assert not any(k.startswith("mtp/") for k in m_on), sorted(m_on)
    for n, t in params(on, head=True).items():
        assert torch.equal(t, head_before[n]), n
    assert not on.head_opt.state and on.head_sched.last_epoch == 0
    s_on, s_off = params(on, head=False), params(off, head=False)
    for n in s_on:
        assert torch.equal(s_on[n], s_off[n]), n
    m = on.train_step(make_batch(50), "dapo", {})  # and the head trains again when asked
    assert m["mtp/grad_norm"] > 0 and on.head_sched.last_epoch == 1
    assert m["mtp/train_seconds"] > 0              # what it added (the trainer's head-training credit reads it)
    with pytest.raises(ValueError, match="train_head='no'"):
        on.train_step(make_batch(50), "dapo", {}, train_head="no")
    close(on, off)


@pytest.mark.parametrize("reduction,fraction", [("token_mean", 1.0), ("seq_mean_token_mean", 1.0),
                                                ("token_mean", 0.25)])
def test_micro_batching_matches_one_batch(tiny_ckpt, reduction, fraction):
    # fraction < 1 (trainer.mtp.loss_position_fraction): each micro-batch trains the positions the whole
    # batch's normaliser counted
    batch = make_batch(60, b=4)
    kw = {"loss_reduction": reduction}
    one, acc = (make(tiny_ckpt, micro_batch_size=m, mtp_loss_position_fraction=fraction) for m in (4, 1))
    m1, m4 = one.train_step(copy.deepcopy(batch), "dapo", kw), acc.train_step(copy.deepcopy(batch), "dapo", kw)
    assert m4["mtp/num_tokens"] == m1["mtp/num_tokens"] > 0
    for k in ("policy/loss", "policy/grad_norm", "mtp/loss", "mtp/grad_norm", "policy/clip_frac_high"):
        assert m4[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-7), k
    close(one, acc)


def test_head_learns_policy_on_fixed_samples(tiny_ckpt):
    pol = make(tiny_ckpt, policy_lr=0.0, head_lr=3e-3, micro_batch_size=4)
    batch = make_batch(5, b=4, s=32)
    batch["loss_mask"][:] = 1
    first = pol.train_step(batch, "dapo", {})
    for _ in range(100):
        last = pol.train_step(batch, "dapo", {})
    assert last["mtp/loss"] < first["mtp/loss"]
    assert last["mtp/top1_agreement_pos_1"] >= 0.9 > first["mtp/top1_agreement_pos_1"]
    close(pol)


def test_bad_inputs(tiny_ckpt, tiny_no_mtp_ckpt, tmp_path):
    with pytest.raises(ModelBuildError, match="num_nextn_predict_layers=0"):
        make(tiny_no_mtp_ckpt, mtp_enabled=True)
    with pytest.raises(PolicyConfigError, match="mtp_loss_type='kl_magic'"):
        PolicyWorkerConfig(mtp_loss_type="kl_magic")
    with pytest.raises(PolicyConfigError, match="mtp_loss_topk=0"):
        PolicyWorkerConfig(mtp_loss_topk=0)
    with pytest.raises(ModelBuildError, match="mtp_num_layers=3"):
        make(tiny_ckpt, mtp_num_layers=3)
    # an HF checkpoint with a missing and an unexpected tensor
    bad = tmp_path / "bad_ckpt"
    shutil.copytree(tiny_ckpt, bad)
    sd = load_file(str(bad / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    sd["model.layers.9.extra.weight"] = torch.zeros(2)
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(WeightMappingError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"
                                                 r".*unexpected \['model.layers.9.extra.weight'\]"):
        make(bad)
    pol = make(tiny_no_mtp_ckpt, mtp_enabled=False)
    b = make_batch()
    del b["advantages"]
    with pytest.raises(BatchError, match="advantages"):
        pol.train_step(b, "dapo", {})
    with pytest.raises(ValueError, match=r"policy_loss='ppo_magic' is not supported; allowed: \('dapo', 'sft'\)"):
        pol.train_step(make_batch(), "ppo_magic", {})
    # a training checkpoint whose model state lacks a tensor / has an extra one
    pol.save_checkpoint(str(tmp_path / "ck"))
    state_file = tmp_path / "ck" / "train_state_rank0.pt"
    state = torch.load(state_file, weights_only=False)
    del state["model"]["decoder.final_layernorm.weight"]
    state["model"]["decoder.layers.7.bogus"] = torch.zeros(1)
    torch.save(state, state_file)
    with pytest.raises(WeightMappingError, match=r"missing \['decoder.final_layernorm.weight'\].*"
                                                 r"unexpected \['decoder.layers.7.bogus'\]"):
        pol.load_checkpoint(str(tmp_path / "ck"))


def test_packed_sequences_match_separate_runs(tiny_ckpt):
    from skyrl_mtp.mtp.draft_head import DraftLossSpec, compute_draft_loss

    pol = make(tiny_ckpt)
    g = torch.Generator().manual_seed(9)
    a, b = torch.randint(0, VOCAB, (1, 10), generator=g), torch.randint(0, VOCAB, (1, 12), generator=g)
    packed = torch.cat([a, b, torch.zeros(1, 2, dtype=torch.long)], 1)
    seg = torch.tensor([[0] * 10 + [1] * 12 + [-1] * 2])
    lp = pol.compute_logprobs({"input_ids": packed, "attention_mask": (seg >= 0).long(), "segment_ids": seg})
    lp_a = pol.compute_logprobs({"input_ids": a, "attention_mask": torch.ones_like(a)})
    lp_b = pol.compute_logprobs({"input_ids": b, "attention_mask": torch.ones_like(b)})
    torch.testing.assert_close(lp[:, 1:10], lp_a[:, 1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp[:, 11:22], lp_b[:, 1:], atol=1e-5, rtol=1e-5)

    def _run(batch):
        batch = prepare(batch)
        with torch.no_grad():
            logits = pol._forward(batch)
            res = compute_draft_loss(pol.model, pol.capture.take(), logits, batch, DraftLossSpec(num_depths=2), VOCAB)
        return [(ls, n) for ls, n, _ in res.per_depth]

    lm_packed = (seg >= 0).float()
    packed_res = _run({"input_ids": packed, "loss_mask": lm_packed, "segment_ids": seg})
    sep = [_run({"input_ids": x, "loss_mask": torch.ones(x.shape)}) for x in (a, b)]
    for d in range(2):
        assert packed_res[d][1] == sep[0][d][1] + sep[1][d][1] == 22 - 2 * (2 + d)
        assert packed_res[d][0] == pytest.approx(sep[0][d][0] + sep[1][d][0], rel=1e-5)
    close(pol)
