"""Rollout throughput with and without MTP speculative decoding (vLLM, same engine build, same prompts).

Why it exists: speculative decoding only pays when drafts are accepted AND drafting is cheap next to the
target forward. This measures both ends: an oracle MTP head (drafts always accepted: the upper bound)
and a random head (drafts never accepted: the lower bound, the pure cost of speculating), for k = 1..3,
against no speculative decoding, on a model big enough that CPU decoding is not pure per-step overhead.

One fresh engine per (k, head), measured at every batch size in turn (--batches; the engine's
max_num_seqs is the largest). k = "auto" is adaptive speculation (rollout/adaptive_speculation.py: k per
engine step from the running batch, live acceptance and on-engine timings, up to --auto-max); its row
carries the mean k it chose (`k_mean`), measured once the engine's first calibration cycles are done (an
RL run pays them once per engine: the warm-up repeats until they are). Every row also says whether its tokens equal its head's no-spec
engine's (`identical_to_no_spec`, greedy: must be true). Generation ignores EOS so every configuration
emits the same number of tokens. `speedup_vs_no_spec` divides by the median no-spec tokens/s of the
heads at that batch (`no_spec_tokens_per_s`: the heads' engines do the same work).

Predicted speedup = (1 + sum_i acceptance_pos_i) / (1 + k * c): tokens per target step over the cost
of one step (verify ~ one target forward, plus k draft forwards). c, the cost of one draft forward
relative to a target forward, is estimated from parameter counts (MTP layer + shared lm_head over the
trunk + lm_head, matmul FLOPs per token); the measured lower bound shows how good that estimate is.

    python benchmarks/rollout_spec.py [--json OUT] [--ks 1 2 3 auto] [--batches 1 16 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# --quick: a smoke size (no-spec and auto-k engines, a small model, one repetition); explicit flags still win
QUICK = dict(draft_heads=["oracle"], ks=["auto"], batches=[2], prompt_len=8, max_tokens=16, reps=1, hidden=128, layers=2, heads=2, kv_heads=1,
             intermediate=384, vocab=1024)


def draft_cost_ratio(spec) -> float:
    """Matmul parameters touched per token by one MTP draft step over one target step (tiny MiMo layout)."""
    h, i, v = spec.hidden, spec.intermediate, spec.vocab
    d = spec.head_dim
    block = h * spec.heads * d * 2 + h * spec.kv_heads * d * 2 + 3 * h * i
    lm_head = v * h
    return (block + 2 * h * h + lm_head) / (spec.layers * block + lm_head)


def counters(llm) -> dict[str, object]:
    out: dict[str, object] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": []}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            out["drafts"] = float(m.value)
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] = float(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] = float(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] = [float(x) for x in m.values]
    return out


def measure(llm, prompts, params, reps: int, adaptive: bool = False) -> dict[str, object]:
    def adaptive_stats():
        return llm.collective_rpc("skyrl_adaptive_speculation_stats")[0] if adaptive else None

    # warm up at the measured batch: its kernel shapes, and (auto) the calibration for its batch bucket and
    # the policy's first calibration cycles, which an RL run pays once per engine, not per rollout
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if adaptive:
        from skyrl_mtp.rollout.adaptive_speculation import SpeculationPolicy

        warmup_steps = SpeculationPolicy(k_max=len(adaptive_stats()["k_histogram"]) - 1).warmup_steps
        for _ in range(16):
            if adaptive_stats()["steps"] >= warmup_steps:
                break
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    before, st0 = counters(llm), adaptive_stats()
    times, tokens = [], 0
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    after, st1 = counters(llm), adaptive_stats()
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted"] - before["accepted"]
    draft_tokens = after["draft_tokens"] - before["draft_tokens"]
    per_pos = [a - b for a, b in zip(after["per_pos"], before["per_pos"] or [0.0] * len(after["per_pos"]))]
    times.sort()
    return {
        "tokens_per_s": tokens / times[len(times) // 2],
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_pos": [x / drafts for x in per_pos] if drafts else [],
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "k_mean": ((st1["k_sum"] - st0["k_sum"]) / (st1["steps"] - st0["steps"])
                   if st1 and st1["steps"] > st0["steps"] else None),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write {'rows': [...]} here")
    ap.add_argument("--ks", nargs="+", default=["1", "2", "3", "auto"], help="ints >= 1 and/or auto")
    ap.add_argument("--auto-max", type=int, default=3, help="the maximum k of the auto rows")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--draft-heads", nargs="+", default=["oracle", "random"], choices=["oracle", "random", "trained"],
                    help="trained: the head in --trained-ckpt (benchmarks/draft_head_training.py --save-trained)")
    ap.add_argument("--trained-ckpt", default=None, help="an HF checkpoint with the oracle's trunk and a trained head")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--cache", default=str(REPO / ".cache" / "bench_tiny"))
    ap.add_argument("--quick", action="store_true", help=f"smoke size {QUICK} (explicit flags still win)")
    a = ap.parse_args(argv)
    if a.quick:
        ap.set_defaults(**QUICK)
        a = ap.parse_args(argv)
    if any(not (k == "auto" or (k.isdigit() and int(k) >= 1)) for k in a.ks):
        ap.error(f"--ks={a.ks} is invalid: every k must be an int >= 1 or auto (k=0, no spec, is always measured)")
    if "trained" in a.draft_heads and not (a.trained_ckpt and (Path(a.trained_ckpt) / "config.json").is_file()):
        ap.error(f"--draft-heads trained needs --trained-ckpt (an HF checkpoint directory); got {a.trained_ckpt!r}")
    if a.auto_max < 1 or any(b < 1 for b in a.batches):
        ap.error(f"--auto-max={a.auto_max} and --batches={a.batches} must be >= 1")
    a.ks = [k if k == "auto" else int(k) for k in a.ks]

    from skyrl_mtp.runtime_env import configure_offline_caches

    configure_offline_caches(os.environ.get("SKYRL_MTP_CACHE", REPO / ".cache"))
    import torch
    from vllm import LLM, SamplingParams

    from skyrl_mtp.models.tiny import TinyModelSpec, cached_tiny_checkpoint
    from skyrl_mtp.rollout.config import EngineConfig
    from skyrl_mtp.rollout.engine import WORKER_EXTENSION_CLS

    shape = dict(hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                 intermediate=a.intermediate, vocab=a.vocab, mtp_layers=1, seed=0)
    oracle = cached_tiny_checkpoint(a.cache, TinyModelSpec(head="oracle", **shape))
    random_ckpt = cached_tiny_checkpoint(a.cache, TinyModelSpec(head="random", **shape))
    c = draft_cost_ratio(TinyModelSpec(**shape))

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 200, (a.prompt_len,), generator=g).tolist() for _ in range(max(a.batches))]
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True, logprobs=1)
    base = dict(model=str(oracle), max_model_len=a.prompt_len + a.max_tokens + 16, max_num_seqs=max(a.batches),
                kv_cache_memory_bytes=128 * 2**20, enforce_eager=True, dtype="float32", seed=0,
                disable_log_stats=False, worker_extension_cls=WORKER_EXTENSION_CLS)

    rows = []
    for k in [0, *a.ks]:
        k_max = a.auto_max if k == "auto" else k
        eng_cfg = EngineConfig(model_path=str(oracle), num_speculative_tokens=k_max, max_num_seqs=max(a.batches),
                               adaptive_speculation=k == "auto")
        spec_cfg = eng_cfg.speculative_config
        sched_kwargs = {"scheduler_cls": eng_cfg.adaptive_scheduler_cls, "async_scheduling": False} if k == "auto" else {}
        for head in a.draft_heads:   # k = 0 too: the two checkpoints' trunks differ (own no-spec reference)
            # a fresh engine per head (the weight sync itself is measured by the trainer: sync/* metrics)
            path = {"random": random_ckpt, "oracle": oracle, "trained": a.trained_ckpt}[head]
            llm = LLM(**{**base, "model": str(path)}, **sched_kwargs,
                      speculative_config=spec_cfg)
            try:
                if k == "auto":
                    llm.collective_rpc("skyrl_install_adaptive_speculation")
                for batch in a.batches:
                    r = measure(llm, prompts[:batch], params, a.reps, adaptive=k == "auto")
                    predicted = (1 + sum(r["per_pos"])) / (1 + k * c) if isinstance(k, int) and k else (
                        1.0 if not k else None)
                    rows.append({"head": head, "k": k, "batch": batch, "tokens_per_s": r["tokens_per_s"],
                                 "acceptance_rate": r["acceptance_rate"],
                                 "mean_acceptance_length": r["mean_acceptance_length"],
                                 "acceptance_per_pos": r["per_pos"], "k_mean": r["k_mean"],
                                 "speedup_vs_no_spec": None, "predicted_speedup": predicted,
                                 "_tokens": r["token_ids"]})
                    print(f"k={k} head={head} batch={batch}: {r['tokens_per_s']:.1f} tok/s", flush=True)
            finally:
                llm.llm_engine.engine_core.shutdown()
                del llm
    ref = {(row["head"], row["batch"]): row for row in rows if row["k"] == 0}
    # every head's no-spec engine does the same work (same shapes; only the weights differ), so the speed
    # reference of a batch is the median of their no-spec rows: one engine measured in a noisy moment
    # does not skew its head's speedups
    no_spec = {b: statistics.median(r["tokens_per_s"] for (_, rb), r in ref.items() if rb == b) for b in a.batches}
    for row in rows:
        base_row = ref[(row["head"], row["batch"])]
        row["no_spec_tokens_per_s"] = no_spec[row["batch"]]
        row["speedup_vs_no_spec"] = row["tokens_per_s"] / no_spec[row["batch"]]
        row["identical_to_no_spec"] = row["_tokens"] == base_row["_tokens"]
    for row in rows:
        del row["_tokens"]

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    print(f"\nmodel: hidden={a.hidden} layers={a.layers} heads={a.heads}/{a.kv_heads} vocab={a.vocab} fp32; "
          f"prompt_len={a.prompt_len} max_tokens={a.max_tokens} (greedy, EOS ignored); "
          f"draft cost ratio c={c:.3f} (parameter estimate)")
    print(f"{'head':>7} {'k':>5} {'batch':>5} {'tok/s':>8} {'accept':>7} {'mean_len':>8} {'k_mean':>6} {'speedup':>8} "
          f"{'predicted':>9} {'same':>5}")
    for row in rows:
        print(f"{str(row['head']):>7} {str(row['k']):>5} {row['batch']:>5} {row['tokens_per_s']:>8.1f} "
              f"{fmt(row['acceptance_rate'], '.3f'):>7} {fmt(row['mean_acceptance_length'], '.2f'):>8} "
              f"{fmt(row['k_mean'], '.2f'):>6} {row['speedup_vs_no_spec']:>7.2f}x "
              f"{fmt(row['predicted_speedup'], '.2f'):>8}x {str(row['identical_to_no_spec']):>5}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
