"""The Megatron policy training an external drafter beside it (drafter_kind "eagle3" or "dflash"), on the tiny llama,
on CPU with real megatron-core (one process, TP=1): the policy's update is bitwise the one without a drafter, the
drafter learns the policy's next-token distribution, and a checkpoint resumes it exactly and exports it as vLLM
loads it."""

import copy

import pytest
import torch

from skyrl_mtp.net import free_port
from skyrl_mtp.policy.config import PolicyWorkerConfig
from skyrl_mtp.policy.megatron_policy import MegatronPolicy, reproducible_metrics

pytestmark = pytest.mark.integration
PORT = free_port()


def make(ckpt, **kw) -> MegatronPolicy:
    base = dict(policy_lr=1e-3, head_lr=3e-3, micro_batch_size=2, seed=0, mtp_enabled=False, mtp_num_layers=0)
    base.update(kw)
    return MegatronPolicy(PolicyWorkerConfig(**base), str(ckpt), 0, 1, "127.0.0.1", PORT)


def make_batch(vocab: int, seed=0, b=4, s=24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    attn = torch.ones(b, s, dtype=torch.long)
    attn[0, -5:] = 0
    loss_mask = torch.zeros(b, s)
    loss_mask[:, 8:] = 1
    loss_mask *= attn
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask,
            "old_logprobs": torch.randn(b, s, generator=g) * 0.1 - 6.0,
            "advantages": torch.randn(b, 1, generator=g).expand(b, s).clone()}


def trunk(p: MegatronPolicy) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in p.model.named_parameters()}


KINDS = {"eagle3": dict(drafter_kind="eagle3", mtp_num_depths=2),
         "dflash": dict(drafter_kind="dflash", drafter_block_size=3, drafter_anchors=8)}
READS = {"eagle3": (0, 1, 2), "dflash": (2,)}   # the tiny llama's 2 layers: EAGLE-3's three ids, DFlash's n // 2 = 1


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_policy_update_is_bitwise_the_one_without_a_drafter_and_the_drafter_learns(tiny_llama_ckpt, kind):
    on = make(tiny_llama_ckpt, **KINDS[kind])
    off = make(tiny_llama_ckpt)
    vocab = on.args.vocab_size
    assert off.drafter is None and on.drafter.aux_layer_ids() == READS[kind]
    start = {n: t.clone() for n, t in on.drafter.iter_weights()}
    for step in range(4):
        batch = make_batch(vocab, 10 + step)
        m_on = on.train_step(copy.deepcopy(batch), "dapo", {})
        m_off = off.train_step(copy.deepcopy(batch), "dapo", {})
        assert {k: v for k, v in m_on.items() if k.startswith("policy/")} == m_off
        assert m_on["mtp/loss"] > 0 and m_on["mtp/grad_norm"] > 0 and m_on["mtp/num_tokens"] > 0
        assert {"mtp/top1_agreement_pos_1", "mtp/top1_agreement_pos_2"} <= m_on.keys()
    for n, t in trunk(on).items():
        assert torch.equal(t, trunk(off)[n]), n
    moved = {n: float((t - start[n]).abs().max()) for n, t in on.drafter.iter_weights()}
    assert all(v > 0 for v in moved.values()), moved
    # on one fixed batch (the policy's lr 0 keeps the teacher fixed) the drafter's top-1 comes to agree with the
    # policy's (the tiny policy is nearly flat, so the soft CE stays near its floor, the policy's entropy)
    fixed = make(tiny_llama_ckpt, **KINDS[kind], policy_lr=0.0, head_lr=1e-2)
    ms = [fixed.train_step(make_batch(vocab, 99), "dapo", {}) for _ in range(12)]
    agree = [m["mtp/top1_agreement_pos_1"] for m in ms]
    assert agree[0] < 0.1 and agree[-1] > 0.25, agree
    assert ms[-1]["mtp/loss"] < ms[0]["mtp/loss"] - 0.02, [m["mtp/loss"] for m in ms]
    for p in (on, fixed):
        p.capture.remove()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_checkpoint_resumes_the_drafter_exactly_and_exports_it_for_vllm(tiny_llama_ckpt, tmp_path, kind):
    from skyrl_mtp.drafters.dflash_export import is_dflash_tensor, load_dflash
    from skyrl_mtp.drafters.eagle3_export import is_eagle3_tensor, load_eagle3

    load, is_tensor = (load_eagle3, is_eagle3_tensor) if kind == "eagle3" else (load_dflash, is_dflash_tensor)
    a = make(tiny_llama_ckpt, **KINDS[kind], head_lr_warmup_steps=3)
    vocab = a.args.vocab_size
    for i in range(2):
        a.train_step(make_batch(vocab, 20 + i), "dapo", {})
    a.save_checkpoint(str(tmp_path / "ck"))
    m_a = [a.train_step(make_batch(vocab, 30 + i), "dapo", {}) for i in range(2)]
    b = make(tiny_llama_ckpt, **KINDS[kind], head_lr_warmup_steps=3, seed=7)   # another initial drafter
    b.load_checkpoint(str(tmp_path / "ck"))
    m_b = [b.train_step(make_batch(vocab, 30 + i), "dapo", {}) for i in range(2)]
    assert [reproducible_metrics(m) for m in m_a] == [reproducible_metrics(m) for m in m_b]
    wa, wb = dict(a.drafter.iter_weights()), dict(b.drafter.iter_weights())
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    # the draft-only export is the drafter as it was at the checkpoint, in vLLM's layout
    exported, cfg = load(tmp_path / "ck" / "draft_head")
    assert cfg == a.drafter.config
    draft = dict(a.iter_hf_weights("draft"))
    assert draft.keys() == exported.state_dict().keys() and all(is_tensor(n) for n in draft)
    assert not any(is_tensor(n) for n, _ in a.iter_hf_weights("main"))
    for p in (a, b):
        p.capture.remove()
