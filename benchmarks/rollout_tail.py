"""Where RL rollouts spend their time, the long tail: no spec, fixed k and auto k on a draining batch.

Why it exists: an RL rollout starts with every request running and drains as responses end; the last
few long responses run at a small batch, where drafting pays most, while drafting at the full batch
costs more than it saves. A fixed k has to pick one side; auto k (speculation/policy.py) picks per step.
This times both on the hidden-512 model of rollout_spec.py with its trained head (`--trained-ckpt`, the
head `draft_head_training.py --variants depth_aware --save-trained DIR` trains; `--head oracle`: the
exact head instead):

- `tail_heavy`: one batch of --requests requests whose per-request max_tokens come from a fixed seeded
  draw (seed 0): each is long with probability 1/8, 8-16x --short-tokens, else 0.5-1.5x --short-tokens;
- `uniform`: the same number of requests, every one --uniform-tokens long.

Greedy, EOS ignored (every engine emits the same tokens, checked: `identical_to_no_spec`). Each engine
(no spec, each k of --ks, auto up to --auto-max) runs in a process of its own, all alive at once; a batch
is timed in --reps interleaved rounds with the order rotated (rollout_spec.py's harness), after --warmup
rollouts of it per engine (kernel shapes; auto times each bucket the batch passes through at every k,
which an RL run pays once per engine). Each rollout is stepped by hand, so every engine step is timed
with the number of requests running.

JSON rows, per batch (`setup`) and engine (`k`): `rollout_seconds` (fastest rollout), `speedup_vs_no_spec`
(the ratio of the fastest rollouts), `speedup_per_rep` (per round) and its median, `tail_time_share` (the
share of that engine's time spent with at most --tail-batch requests running; the no-spec row's is the
batch's), `k_mean_large` / `k_mean_small` (mean k over the timed rounds' steps with more / at most
--tail-batch requests: auto's choice, a fixed k's own k), acceptance.

    python benchmarks/rollout_tail.py --trained-ckpt DIR [--ks 1 2 3 auto] [--reps 5] [--json OUT] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from rollout_spec import EngineProcess, paired_speedup  # noqa: E402  (benchmarks/ is this script's path entry)

QUICK = dict(head="oracle", ks=["auto"], requests=8, short_tokens=6, uniform_tokens=12, reps=1, warmup=1, hidden=128,
             layers=2, heads=2, kv_heads=1, intermediate=384, vocab=1024)
SMALL_BUCKETS = ("1", "2", "3-4", "5-8")   # policy buckets at most 8 requests (speculation.policy.bucket_label)


def tail_heavy_lengths(requests: int, short: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(8 * short, 16 * short) if rng.random() < 1 / 8 else rng.randint(max(short // 2, 1), 3 * short // 2)
            for _ in range(requests)]


def k_means(before: dict | None, after: dict | None, k) -> tuple[float | None, float | None]:
    """Mean k over the steps with more than 8 and with at most 8 requests, from the policy's per-bucket
    histograms (auto), or a fixed k's own."""
    if before is None or after is None:
        return float(k), float(k)
    out = []
    for small in (False, True):
        hist = [0] * len(after["k_histogram"])
        for label, counts in after["bucket_k_histogram"].items():
            if (label in SMALL_BUCKETS) == small:
                old = before["bucket_k_histogram"].get(label, [0] * len(counts))
                hist = [h + c - o for h, c, o in zip(hist, counts, old)]
        out.append(sum(j * n for j, n in enumerate(hist)) / sum(hist) if sum(hist) else None)
    return out[0], out[1]


def measure(engines: dict, prompts, lengths, a, settle_s: float) -> dict:
    samplings = [dict(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in lengths]
    for engine in engines.values():
        for _ in range(a.warmup):
            time.sleep(settle_s)
            engine.call("stepped", prompts, samplings)
    keys = list(engines)
    before = {key: (e.call("counters"), e.call("adaptive_stats") if e.adaptive else None) for key, e in engines.items()}
    runs: dict = {key: [] for key in keys}
    for rep in range(a.reps):
        for key in keys[rep % len(keys):] + keys[:rep % len(keys)]:
            time.sleep(settle_s)
            runs[key].append(engines[key].call("stepped", prompts, samplings))
    out = {}
    for key, engine in engines.items():
        c0, st0 = before[key]
        delta = engine.call("counters") - c0
        steps = [s for _, run_steps, _ in runs[key] for s in run_steps]
        tail = sum(sec for running, sec in steps if running <= a.tail_batch) / sum(sec for _, sec in steps)
        large, small = k_means(st0, engine.call("adaptive_stats") if engine.adaptive else None, key)
        out[key] = {"times": [t for t, _, _ in runs[key]], "tokens": runs[key][-1][2], "tail_time_share": tail,
                    "k_mean_large": large, "k_mean_small": small,
                    "acceptance_rate": (delta.num_accepted_tokens / delta.num_draft_tokens
                                        if delta.num_draft_tokens else None)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--head", choices=["trained", "oracle"], default="trained")
    ap.add_argument("--trained-ckpt", default=None, help="an HF checkpoint with the oracle's trunk and a trained head")
    ap.add_argument("--ks", nargs="+", default=["1", "2", "3", "auto"])
    ap.add_argument("--auto-max", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--short-tokens", type=int, default=24, help="tail_heavy: a short response's typical length")
    ap.add_argument("--uniform-tokens", type=int, default=48, help="uniform: every response's length")
    ap.add_argument("--tail-batch", type=int, default=8, help="the tail: at most this many requests running")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3, help="rollouts of each batch per engine before the timed ones")
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
        ap.error(f"--ks={a.ks} is invalid: every k must be an int >= 1 or auto (no spec is always measured)")
    if a.head == "trained" and not (a.trained_ckpt and (Path(a.trained_ckpt) / "config.json").is_file()):
        ap.error(f"--head trained needs --trained-ckpt (an HF checkpoint directory); got {a.trained_ckpt!r}")
    if min(a.requests, a.short_tokens, a.uniform_tokens, a.reps, a.auto_max) < 1 or a.warmup < 0:
        ap.error("--requests, --short-tokens, --uniform-tokens, --reps and --auto-max must be >= 1, --warmup >= 0")
    ks = [0] + [k if k == "auto" else int(k) for k in a.ks]

    from skyrl_mtp.runtime_env import configure_offline_caches

    cache = str(os.environ.get("SKYRL_MTP_CACHE", REPO / ".cache"))
    configure_offline_caches(cache)
    import torch

    from skyrl_mtp.models.tiny import TinyModelSpec, cached_tiny_checkpoint
    from skyrl_mtp.rollout.config import EngineConfig
    from skyrl_mtp.rollout.engine import WORKER_EXTENSION_CLS

    shape = dict(hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads, intermediate=a.intermediate,
                 vocab=a.vocab, mtp_layers=1, seed=0)
    path = str(a.trained_ckpt if a.head == "trained" else cached_tiny_checkpoint(a.cache, TinyModelSpec(head="oracle", **shape)))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 200, (a.prompt_len,), generator=g).tolist() for _ in range(a.requests)]
    setups = {"tail_heavy": tail_heavy_lengths(a.requests, a.short_tokens), "uniform": [a.uniform_tokens] * a.requests}
    base = dict(model=path, max_model_len=a.prompt_len + max(max(v) for v in setups.values()) + 16,
                max_num_seqs=a.requests, kv_cache_memory_bytes=256 * 2**20, enforce_eager=True, dtype="float32", seed=0,
                disable_log_stats=False, worker_extension_cls=WORKER_EXTENSION_CLS)
    rows, engines = [], {}
    try:
        for k in ks:
            cfg = EngineConfig(model_path=path, num_speculative_tokens=a.auto_max if k == "auto" else k,
                               max_num_seqs=a.requests, adaptive_speculation=k == "auto")
            managed = cfg.managed_engine_kwargs(WORKER_EXTENSION_CLS)
            extra = {key: managed[key] for key in ("scheduler_cls", "async_scheduling", "additional_config")} if k == "auto" else {}
            engines[k] = EngineProcess({**base, **extra, "speculative_config": cfg.speculative_config},
                                       adaptive=k == "auto", cache=cache)
        settle_s = engines[0].call("worker_spin_seconds") + 0.25
        for setup, lengths in setups.items():
            measured = measure(engines, prompts, lengths, a, settle_s)
            ref = measured[0]
            for k, r in measured.items():
                per_rep = paired_speedup(r["times"], ref["times"])
                rows.append({"setup": setup, "k": k, "rollout_seconds": min(r["times"]), "rollout_seconds_per_rep": r["times"],
                             "speedup_vs_no_spec": min(ref["times"]) / min(r["times"]), "speedup_per_rep": per_rep,
                             "speedup_median_of_rounds": statistics.median(per_rep),
                             "tail_time_share": r["tail_time_share"], "k_mean_large": r["k_mean_large"],
                             "k_mean_small": r["k_mean_small"], "acceptance_rate": r["acceptance_rate"],
                             "tokens": sum(map(len, r["tokens"])), "identical_to_no_spec": r["tokens"] == ref["tokens"]})
                print(f"{setup} k={k}: {min(r['times']):.2f} s, speedup {rows[-1]['speedup_vs_no_spec']:.2f}x", flush=True)
    finally:
        for engine in engines.values():
            engine.close()

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    print(f"\nmodel: hidden={a.hidden} layers={a.layers} vocab={a.vocab} fp32, head {a.head}; {a.requests} requests, "
          f"tail_heavy max_tokens {sorted(setups['tail_heavy'])}, uniform {a.uniform_tokens}; greedy, EOS ignored")
    print(f"{'setup':>10} {'k':>5} {'seconds':>8} {'speedup':>8} {'per-round range':>15} {'median':>7} {'tail':>6} "
          f"{'k large':>8} {'k small':>8} {'accept':>7} {'same':>5}")
    for r in rows:
        print(f"{r['setup']:>10} {str(r['k']):>5} {r['rollout_seconds']:>8.2f} {r['speedup_vs_no_spec']:>7.2f}x "
              f"{min(r['speedup_per_rep']):>7.2f}-{max(r['speedup_per_rep']):.2f}x {r['speedup_median_of_rounds']:>6.2f}x "
              f"{r['tail_time_share']:>6.2f} {fmt(r['k_mean_large'], '.2f'):>8} {fmt(r['k_mean_small'], '.2f'):>8} "
              f"{fmt(r['acceptance_rate'], '.3f'):>7} {str(r['identical_to_no_spec']):>5}")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": {**shape, "head": a.head, "path": path}, "requests": a.requests,
                                            "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
