"""The GPU memory plan of an EAGLE-3 run (config/memory_drafter.py): the drafter's parameters against the module the
policy workers build, its saved activations against what autograd keeps on a tiny drafter, and a Llama-3.1-8B run's
plan against the same run without the drafter, every difference computed by hand."""

from __future__ import annotations

import pytest
import torch
from eagle3_target_configs import LLAMA_3_1_8B, QWEN3_8B
from model_configs import write_config

from skyrl_mtp.config import compose_config
from skyrl_mtp.config.memory_drafter import (
    eagle3_attention_bytes,
    eagle3_param_count,
    eagle3_params,
    eagle3_pass_elements,
)
from skyrl_mtp.config.memory_plan import GIB, MIB, WORKSPACES, memory_plan, model_shape
from skyrl_mtp.drafters.eagle3 import Eagle3Config, Eagle3Drafter, unroll
from skyrl_mtp.models.families.base import ModelShape

# Llama-3.1-8B's drafter by hand: fc 4096 x 12288; q_proj 4096 x 8192; k_proj, v_proj 1024 x 8192; o_proj 4096 x 4096;
# gate, up, down 4096 x 14336; four RMSNorms of 4096
LLAMA_DRAFTER = 4096 * 12288 + 4096 * 8192 + 2 * 1024 * 8192 + 4096 * 4096 + 3 * 4096 * 14336 + 4 * 4096


@pytest.fixture()
def llama(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": [{"role": "user", "content": "1+1"}], "reward_model": {"ground_truth": "2"}}\n')
    return ["recipe=llama3_1_8b_eagle3_dapo", f"model.path={write_config(tmp_path / 'llama', LLAMA_3_1_8B)}",
            f"data.train_files=[{rows}]"]


def _shape(hf: dict) -> ModelShape:
    return model_shape(compose_config(["recipe=tiny_dapo", "trainer.mtp.enabled=false"]), hf)


def test_llama_drafter_parameters_by_hand():
    assert LLAMA_DRAFTER == 293_617_664
    shape = _shape(LLAMA_3_1_8B)
    # vLLM shards q/k/v, o and the MLP over an engine's TP; fc (ReplicatedLinear) and the norms are whole
    assert eagle3_params(shape) == (4096 * 8192 + 2 * 1024 * 8192 + 4096 * 4096 + 3 * 4096 * 14336,
                                    4096 * 12288 + 4 * 4096) == (243_269_632, 50_348_032)


@pytest.mark.parametrize("hf", [LLAMA_3_1_8B, QWEN3_8B], ids=["llama3_1_8b", "qwen3_8b"])
def test_the_count_is_the_drafter_the_policy_workers_build(hf):
    with torch.device("meta"):   # the real module at full size, without its memory
        drafter = Eagle3Drafter(Eagle3Config.from_target(hf))
    assert eagle3_param_count(_shape(hf)) == sum(p.numel() for p in drafter.parameters())


def test_a_pass_saves_what_the_plan_counts_on_a_tiny_drafter():
    # every tensor autograd keeps for backward over a 3-pass unroll (and the outputs the loss reads), parameters aside:
    # those of at least H fp32 elements per token are exactly the plan's activations plus each pass's probabilities;
    # the rest (RoPE's cos / sin, the norms' rsqrt, the bool mask) are below a hidden size per token in all
    h, a, g, d, f, vocab, rows, seq, depths = 64, 4, 2, 16, 96, 100, 2, 24, 3
    cfg = Eagle3Config(hidden_size=h, intermediate_size=f, num_attention_heads=a, num_key_value_heads=g, head_dim=d,
                       rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=vocab, max_position_embeddings=256,
                       target_num_layers=4, aux_layer_ids=(1, 2, 3))
    gen = torch.Generator().manual_seed(0)
    drafter = Eagle3Drafter(cfg, gen)
    own = {p.untyped_storage().data_ptr() for p in drafter.parameters()}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in own:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    aux = torch.randn(rows, seq, 3 * h, generator=gen)
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        outs = unroll(drafter, aux, ids, torch.randn(vocab, h, generator=gen), depths)
    for out in outs:
        for t in (out.hidden, out.next_hidden):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    tokens = rows * seq
    big = sum(n for n in saved.values() if n >= tokens * h * 4)
    shape = ModelShape(hidden=h, layers=4, attention_layers=4, heads=a, kv_heads=g, head_dim=d, intermediate=f,
                       vocab=vocab, params_sharded=0, params_replicated=0, mtp_layers=0, mtp_params_sharded=0,
                       mtp_params_replicated=0, largest_tensor=0)
    passes = eagle3_pass_elements(shape, first=True) + (depths - 1) * eagle3_pass_elements(shape, first=False)
    assert passes == (11 * h + 4 * a * d + 4 * f) + 2 * (10 * h + 4 * a * d + 4 * f)
    probs = sum(rows * a * seq * (seq + j) * 4 for j in range(depths))   # pass j also scores its j diagonal keys
    assert big == tokens * 3 * h * 4 + tokens * passes * 4 + probs      # fc's fp32 input, the passes, the scores
    small = sum(n for n in saved.values() if n < tokens * h * 4)
    assert 0 < small < depths * tokens * h * 4
    # the plan's scores: each pass's [S, S] probabilities, two more at the peak, the mask and its negation
    assert eagle3_attention_bytes(shape, rows=rows, seq=seq, depths=depths) == \
        (depths + 2) * rows * a * seq * seq * 4 + 2 * rows * seq * seq >= probs


def test_an_eagle3_run_needs_the_drafters_bytes_on_top_of_the_same_run_without_it(llama):
    # the recipe: TP 4 x DP 2, micro-batch 1 of 1024 + 4096 tokens, k = 3, train_depths 3, chunk 2048, a 12 GiB KV
    # cache, engines of TP 1; kind=mtp on a model without MTP layers plans no drafter at all, at the same k
    eagle = memory_plan(compose_config(llama), LLAMA_3_1_8B)
    bare = memory_plan(compose_config([*llama, "trainer.drafter.kind=mtp"]), LLAMA_3_1_8B, suggest=False)
    p, q = eagle.policy, bare.policy
    assert (p.weights, p.grads, p.optimizer) == (q.weights, q.grads, q.optimizer)
    assert p.drafter == 16 * LLAMA_DRAFTER == 4_697_882_624           # fp32 weights, grads, two AdamW moments
    assert p.drafter_weights == 4 * LLAMA_DRAFTER
    assert p.resident - q.resident == p.offloaded - q.offloaded == p.drafter
    tokens, v = 5120, 128256 // 4
    parts = {
        "captured states": 3 * tokens * 4096 * 2,                        # three [S, B, H] bf16 layer inputs
        # fc's input in bf16 and fp32, then per token: the first pass 11 H + 4 a d + 4 F, each later one 10 H + ...
        "drafter activations": 3 * tokens * 4096 * 6 + tokens * 4 * ((11 + 2 * 10) * 4096 + 3 * 4 * 4096
                                                                    + 3 * 4 * 14336),
        # 3 passes' fp32 [32 heads, S, S] + 2 at the peak; the bool mask and its negation
        "drafter attention": 5 * 32 * tokens * tokens * 4 + 2 * tokens * tokens,
        # 4096 response tokens' teacher rows (bf16), a 2048-token chunk (fp32 x 4), 3 depths' student rows + grads
        "draft loss": 4096 * v * 2 + 2048 * v * 16 + 3 * 4096 * 4096 * 2 * 2,
    }
    assert dict(p.draft_parts) == parts
    assert parts == {"captured states": 125_829_120, "drafter activations": 7_507_804_160,
                     "drafter attention": 16_829_644_800, "draft loss": 1_514_668_032}
    assert q.draft_loss == 0 and "draft loss" not in q.step_phases
    assert p.step_phases["draft loss"] == {"logits": p.logits, **parts, "attention buffer": 0, "workspaces": WORKSPACES}
    assert p.step_peak == ("draft loss", p.logits + sum(parts.values()) + WORKSPACES)
    e, f = eagle.engine, bare.engine
    assert e.drafter == LLAMA_DRAFTER * 2 and f.drafter == 0             # bf16, whole at engine TP 1
    assert e.activations - f.activations == 2 * 3 * 16384 * 4096 * 2     # the aux states of a 16384-token step
    assert (e.kv_tokens, f.kv_tokens) == (12288 * MIB // (2 * 33 * 8 * 128 * 2), 12288 * MIB // (2 * 32 * 8 * 128 * 2))
    assert eagle.phases["rollout (engines awake)"] - bare.phases["rollout (engines awake)"] == \
        p.drafter + e.drafter + 2 * 3 * 16384 * 4096 * 2
    assert eagle.phases["training (engines asleep)"] == p.resident + p.logits + sum(parts.values()) + WORKSPACES \
        + 2 * GIB
    assert eagle.free_at_engine_start == bare.free_at_engine_start - 4 * LLAMA_DRAFTER   # its weights, from the start
    assert not eagle.offload_while_engines_awake and not eagle.problems


def test_a_drafter_too_large_for_the_gpu_is_refused_naming_fewer_depths(llama):
    cfg = compose_config([*llama, "generator.max_model_len=9216", "generator.sampling.max_tokens=8192"])
    plan = memory_plan(cfg, LLAMA_3_1_8B)
    (msg,) = plan.problems
    assert "peak in the draft loss phase: weights 4.0 GB + grads 8.0 GB + optimizer 12.0 GB + drafter (fp32, AdamW) " \
           "4.7 GB + process overhead 1.6 GB" in msg
    # 5 x 4 B x 32 heads x 9216^2 + the mask: 54.5 GB; one pass (train_depths=1) keeps one set of scores
    assert "drafter attention 54.5 GB" in msg
    assert msg.startswith("trainer.mtp.train_depths=3 is invalid: a training step needs 105.2 GB per GPU")
    assert msg.endswith("settings that fit: trainer.mtp.train_depths=1 needs 74.8 GB")
