"""The GPU memory plan of an EAGLE-3 or DFlash run (config/memory_drafter.py): the drafter's parameters against the
module the policy workers build, its saved activations against what autograd keeps on a tiny drafter, and a
Llama-3.1-8B (EAGLE-3) and a Qwen3-8B (DFlash) run's plan against the same run without the drafter, every
difference computed by hand."""

from __future__ import annotations

import pytest
import torch
from eagle3_target_configs import LLAMA_3_1_8B, QWEN3_8B
from model_configs import write_config

from skyrl_mtp.config import compose_config
from skyrl_mtp.config.memory_drafter import (
    DFlashSettings,
    dflash_attention_bytes,
    dflash_context_elements,
    dflash_param_count,
    dflash_params,
    dflash_query_elements,
    dflash_settings,
    eagle3_attention_bytes,
    eagle3_param_count,
    eagle3_params,
    eagle3_pass_elements,
)
from skyrl_mtp.config.memory_plan import GIB, MIB, WORKSPACES, memory_plan, model_shape
from skyrl_mtp.drafters.dflash import DFlashConfig, DFlashDrafter, block_hidden
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


# ---------------------------------------------------------------------------------------------- DFlash

# a DFlash drafter of Qwen3-8B's width by hand, per layer: q_proj 4096 x 4096, k_proj and v_proj 1024 x 4096, o_proj
# 4096 x 4096, gate / up / down 4096 x 12288 (sharded by an engine's TP); input / post-attention norms of 4096 and
# q / k norms of 128; then fc 4096 x (n_ids x 4096), hidden_norm and norm of 4096
QWEN3_DFLASH_LAYER = 4096 * 4096 + 2 * 1024 * 4096 + 4096 * 4096 + 3 * 4096 * 12288
QWEN3_DFLASH_2 = 2 * QWEN3_DFLASH_LAYER + 2 * 4096 * 4096 + 2 * (2 * 4096 + 2 * 128) + 2 * 4096   # 2 layers, 2 ids
QWEN3_DFLASH_5 = 5 * QWEN3_DFLASH_LAYER + 5 * 4096 * 4096 + 5 * (2 * 4096 + 2 * 128) + 2 * 4096   # 5 layers, 5 ids


def test_qwen3_dflash_drafter_parameters_by_hand():
    assert QWEN3_DFLASH_LAYER == 192_937_984
    assert QWEN3_DFLASH_2 == 419_455_488 and QWEN3_DFLASH_5 == 1_048_626_432
    shape = _shape(QWEN3_8B)
    assert (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate,
            shape.vocab) == (4096, 36, 32, 8, 128, 12288, 151936)
    two = DFlashSettings(layers=2, n_ids=2, block=8, anchors=32)
    assert dflash_params(shape, two) == (2 * QWEN3_DFLASH_LAYER, 2 * 4096 * 4096 + 2 * 8448 + 8192) \
        == (385_875_968, 33_579_520)
    assert dflash_param_count(shape, DFlashSettings(layers=5, n_ids=5, block=16, anchors=32)) == QWEN3_DFLASH_5
    # fc reads one state per layer id, whatever the layer count
    assert dflash_param_count(shape, DFlashSettings(layers=2, n_ids=3, block=8, anchors=32)) == \
        QWEN3_DFLASH_2 + 4096 * 4096


def test_the_run_resolves_the_drafters_settings_as_the_workers_do():
    shape = _shape(QWEN3_8B)
    base = ["recipe=tiny_dapo", "trainer.drafter.kind=dflash", "trainer.mtp.num_speculative_tokens=3"]
    # default_target_layer_ids(36, 2) = (1, 33): one id per layer; block_size null = k + 1
    assert dflash_settings(compose_config([*base, "trainer.drafter.num_layers=2"]), shape) == \
        DFlashSettings(layers=2, n_ids=2, block=4, anchors=32)
    assert dflash_settings(compose_config([*base, "trainer.drafter.layer_ids=[2,10,20]", "trainer.drafter.block_size=6",
                                           "trainer.drafter.anchors=8"]), shape) == \
        DFlashSettings(layers=1, n_ids=3, block=6, anchors=8)


@pytest.mark.parametrize("layers, ids", [(1, None), (2, None), (5, None), (2, (3, 17, 30))])
def test_the_dflash_count_is_the_drafter_the_policy_workers_build(layers, ids):
    with torch.device("meta"):   # the real module at Qwen3-8B's size, without its memory
        drafter = DFlashDrafter(DFlashConfig.from_target(QWEN3_8B, ids, num_layers=layers))
    s = DFlashSettings(layers=layers, n_ids=len(drafter.cfg.target_layer_ids), block=8, anchors=32)
    assert dflash_param_count(_shape(QWEN3_8B), s) == sum(p.numel() for p in drafter.parameters())


def _tiny_dflash(layers: int, n_ids: int):
    h, a, g, d, f, vocab = 64, 4, 2, 16, 96, 100
    cfg = DFlashConfig(hidden_size=h, intermediate_size=f, num_attention_heads=a, num_key_value_heads=g, head_dim=d,
                       rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=vocab, max_position_embeddings=256,
                       target_num_layers=6, target_layer_ids=tuple(range(1, 1 + n_ids)), num_layers=layers,
                       block_size=4, mask_token_id=vocab - 1)
    shape = ModelShape(hidden=h, layers=6, attention_layers=6, heads=a, kv_heads=g, head_dim=d, intermediate=f,
                       vocab=vocab, params_sharded=0, params_replicated=0, mtp_layers=0, mtp_params_sharded=0,
                       mtp_params_replicated=0, largest_tensor=0)
    return cfg, shape


def test_a_small_dflash_drafters_count_is_its_modules():
    cfg, shape = _tiny_dflash(layers=3, n_ids=2)
    drafter = DFlashDrafter(cfg, torch.Generator().manual_seed(0))
    s = DFlashSettings(layers=3, n_ids=2, block=4, anchors=3)
    assert dflash_param_count(shape, s) == sum(p.numel() for p in drafter.parameters()) == \
        3 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 64 * 96 + 2 * 64 + 2 * 16) + 2 * 64 * 64 + 2 * 64


def test_block_hidden_saves_what_the_plan_counts_on_a_tiny_drafter():
    # every tensor autograd keeps for backward over block_hidden (and the output the loss reads), parameters aside:
    # the fp32 ones above 2 KB are exactly fc's input, the context pass, the query pass and each layer's
    # probabilities; the bool ones each layer's negated mask; the rest (RoPE's cos / sin, the norms' rsqrt) are small
    layers, n_ids, rows, seq, blocks = 2, 2, 2, 24, 3
    cfg, shape = _tiny_dflash(layers, n_ids)
    h, a, bs = shape.hidden, shape.heads, cfg.block_size
    gen = torch.Generator().manual_seed(0)
    drafter = DFlashDrafter(cfg, gen)
    own = {p.untyped_storage().data_ptr() for p in drafter.parameters()}
    saved: dict[int, tuple[int, torch.dtype]] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in own:
            saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dtype)
        return t

    aux = torch.randn(rows, seq, n_ids * h, generator=gen)
    ids = torch.randint(0, cfg.vocab_size - 1, (rows, seq), generator=gen)
    anchors = torch.tensor([[3, 9, 15], [2, 11, 20]])
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = block_hidden(drafter, aux, ids, torch.randn(cfg.vocab_size, h, generator=gen), anchors)
    saved[out.untyped_storage().data_ptr()] = (out.untyped_storage().nbytes(), out.dtype)
    s = DFlashSettings(layers=layers, n_ids=n_ids, block=bs, anchors=blocks)
    tokens, queries = rows * seq, rows * blocks * bs
    assert dflash_context_elements(shape, s) == 3 * h + layers * (2 * 2 * 16 + 2 * 4 * 16)
    assert dflash_query_elements(shape, s) == 5 * h + 6 * h + 3 * h + layers * (6 * 4 * 16 + 2 * 2 * 16 + 4 * 96)
    probs = layers * queries * a * (seq + bs) * 4             # [rows, heads, blocks x bs, S + bs] fp32
    big = sum(n for n, dt in saved.values() if dt == torch.float32 and n > 2048)
    assert big == (tokens * n_ids * h * 4 + tokens * dflash_context_elements(shape, s) * 4
                   + queries * dflash_query_elements(shape, s) * 4 + probs)
    assert sum(n for n, dt in saved.values() if dt == torch.bool) == layers * queries * seq
    small = sum(n for n, dt in saved.values() if dt != torch.bool and n <= 2048)
    assert 0 < small < tokens * h * 4
    # the plan's scores: each layer's probabilities, two more at the peak, the mask and each layer's negation
    assert dflash_attention_bytes(shape, s, rows=rows, seq=seq, blocks=blocks) == \
        (layers + 2) * queries * a * (seq + bs) * 4 + (layers + 1) * queries * seq >= probs + layers * queries * seq


@pytest.fixture()
def qwen3_dflash(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": [{"role": "user", "content": "1+1"}], "reward_model": {"ground_truth": "2"}}\n')
    return ["recipe=qwen3_8b_dflash_dapo", f"model.path={write_config(tmp_path / 'qwen3', QWEN3_8B)}",
            f"data.train_files=[{rows}]"]


def test_a_dflash_run_needs_the_drafters_bytes_on_top_of_the_same_run_without_it(qwen3_dflash):
    # the recipe: TP 4 x DP 2, micro-batch 1 of 1024 + 5120 tokens, k = 7, a drafter of 2 layers reading 2 states,
    # blocks of 8, 32 anchors per row, chunk 2048, engines of TP 1; kind=mtp on a model without MTP layers plans no
    # drafter at all, at the same k
    cfg = compose_config(qwen3_dflash)
    dflash = memory_plan(cfg, QWEN3_8B)
    bare = memory_plan(compose_config([*qwen3_dflash, "trainer.drafter.kind=mtp"]), QWEN3_8B, suggest=False)
    p, q = dflash.policy, bare.policy
    assert (p.weights, p.grads, p.optimizer) == (q.weights, q.grads, q.optimizer)
    assert p.drafter == 16 * QWEN3_DFLASH_2 == 6_711_287_808            # fp32 weights, grads, two AdamW moments
    assert p.drafter_weights == 4 * QWEN3_DFLASH_2
    assert p.resident - q.resident == p.offloaded - q.offloaded == p.drafter
    tokens, v, slots = 6144, 151936 // 4, 32 * 8
    parts = {
        "captured states": 2 * tokens * 4096 * 2,                        # two [S, B, H] bf16 layer inputs
        # fc's input in bf16 and fp32; per position fc's output, hidden_norm's normalised input and output, and per
        # layer k_norm's input and normalised input (2 x 1024) and the keys and values repeated to 32 heads (2 x 4096)
        "drafter context": 2 * tokens * 4096 * 6 + tokens * 4 * (3 * 4096 + 2 * (2 * 1024 + 2 * 4096)),
        # per slot: layer 0 5 H, layer 1 6 H, each 6 a d + 2 g d + 4 F, the final norm 3 H
        "drafter blocks": slots * 4 * (14 * 4096 + 2 * (6 * 4096 + 2 * 1024 + 4 * 12288)),
        # 2 layers' fp32 [32 heads, 256, 6144 + 8] + 2 at the peak; the bool mask and each layer's negation
        "drafter attention": 4 * 32 * slots * (tokens + 8) * 4 + 3 * slots * tokens,
        # one slot's 32 teacher rows (bf16), their chunk (fp32 x 4), 7 slots' student rows + grads
        "draft loss": 32 * v * 2 + 32 * v * 16 + 7 * 32 * 4096 * 2 * 2,
    }
    assert dict(p.draft_parts) == parts
    assert parts == {"captured states": 100_663_296, "drafter context": 1_107_296_256,
                     "drafter blocks": 213_909_504, "drafter attention": 811_073_536, "draft loss": 25_548_800}
    assert q.draft_loss == 0 and "draft loss" not in q.step_phases
    assert p.step_phases["draft loss"] == {"logits": p.logits, **parts, "attention buffer": 0, "workspaces": WORKSPACES}
    e, f = dflash.engine, bare.engine
    # bf16, whole at engine TP 1, and the copy of both layers' k/v rows (2 x 1024 x 4096) and k_norm weights (128)
    # vLLM builds for its context K/V, and the mask embedding (4096)
    assert e.drafter == (QWEN3_DFLASH_2 + 2 * (2 * 1024 * 4096 + 128) + 4096) * 2 and f.drafter == 0
    # the two aux states of a 16384-token step and their concatenation, fc's output and its norm, both layers'
    # context K / V twice; 256 sequences' 7 draft logits over the vocabulary at once (bf16)
    drafter_act = (16384 * (4 * 4096 + 2 * 4096 + 4 * 2 * 1024) + 256 * 7 * 151936) * 2
    assert e.activations - f.activations == drafter_act == 1_618_280_448
    kv = int(cfg.generator.kv_cache_memory_mb) * MIB
    assert (e.kv_tokens, f.kv_tokens) == (kv // (2 * 38 * 8 * 128 * 2), kv // (2 * 36 * 8 * 128 * 2))
    assert dflash.phases["rollout (engines awake)"] - bare.phases["rollout (engines awake)"] == \
        p.drafter + e.drafter + drafter_act
    assert dflash.free_at_engine_start == bare.free_at_engine_start - 4 * QWEN3_DFLASH_2
    assert not dflash.offload_while_engines_awake and not dflash.problems


def test_too_many_dflash_blocks_for_the_gpu_are_refused_naming_fewer_anchors(qwen3_dflash):
    # 4096 anchors of a 5120-token response: 32768 queries per layer, each scoring 6152 keys in fp32 over 32 heads
    cfg = compose_config([*qwen3_dflash, "trainer.drafter.anchors=4096"])
    (msg,) = memory_plan(cfg, QWEN3_8B).problems
    assert msg.startswith("trainer.drafter.anchors=4096 is invalid: a training step needs ")
    assert "drafter (fp32, AdamW) 6.7 GB" in msg and "drafter attention 103.8 GB" in msg
    assert "settings that fit: trainer.drafter.anchors=1024 needs" in msg
