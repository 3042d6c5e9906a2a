"""Cost of the decoupled draft loss relative to the policy's own forward+backward.

Why: the MTP head is trained in the same step as the policy; this measures what that costs. For each
draft-loss type (chunked and not): time and peak memory of the MTP replay + loss forward/backward,
as a ratio to the policy forward+backward of the same batch; the full train-step time ratio
MTP-on / MTP-off; and (``--breakdown``) where the MTP-on extra time goes. Runs real megatron-core
(CPU shim without CUDA) on a checkpoint of the tiny checkpoint factory built at the requested size.

    python benchmarks/draft_loss.py [--json OUT] [--hidden 512 --layers 8 --vocab 8192 --batch 2 --seq 512]

The train steps chunk the draft loss as a run does (``megatron.mtp_loss_chunk_size``, default auto: one
chunk at this size on CPU); ``--train-chunk`` sets it. Times are the minimum over ``--reps`` runs (wall
clock, and the process CPU time, which is less sensitive to other processes sharing the cores); on/off
train steps are interleaved.
The loss math alone (no Megatron) is benchmarked by ``benchmarks/draft_loss_math.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LOSS_TYPES = ("soft_ce", "hard_ce", "topk_soft_ce", "tv")
# --quick: a smoke size (every loss type, tiny shapes) that finishes in seconds; explicit flags still win
QUICK = dict(hidden=128, layers=2, vocab=1024, batch=2, seq=64, chunk=32, reps=1)


def peak_memory_mb(fn) -> float:
    """Peak bytes held by tensors allocated during ``fn`` (CUDA allocator stats on GPU; on CPU the
    running sum of the profiler's allocation/free events, which ignores allocator caching)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak / 2**20


def timed(fn) -> tuple[float, float]:
    """(wall ms, process CPU ms) of one call."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    w, c = time.perf_counter(), time.process_time()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - w) * 1e3, (time.process_time() - c) * 1e3


def best_of(fns: dict, reps: int) -> dict[str, tuple[float, float]]:
    """Warm each function once, then run them interleaved ``reps`` times; min wall and min CPU ms each."""
    for fn in fns.values():
        fn()
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            runs[k].append(timed(fn))
    return {k: (min(r[0] for r in v), min(r[1] for r in v)) for k, v in runs.items()}


def flop_floor_ratio(a, position_fraction: float = 1.0) -> float:
    """(policy step + the head's own work) / policy step, in matmul FLOPs (the floor an implementation
    can reach: nothing counted twice). Policy step: fwd + bwd = 6 FLOPs per parameter per token over
    the trunk and lm_head. Head: its block and eh_proj fwd + bwd (6 per parameter per token, every
    position), plus the projection through the DETACHED output layer at the trained positions: fwd and
    the input gradient only (4 * V * H per position). The teacher is the policy's own logits (no extra
    work)."""
    h, layers, v = a.hidden, a.layers, a.vocab
    heads, kv_heads, inter = h // 64, max(1, h // 128), 3 * h
    block = h * heads * 64 * 2 + h * kv_heads * 64 * 2 + 3 * h * inter
    policy = 6 * (layers * block + v * h)
    head = 6 * (block + 2 * h * h) + 4 * v * h * position_fraction
    return (policy + head) / policy


def build_checkpoint(out: Path, a) -> Path:
    from skyrl_mtp.models.tiny import TinyModelSpec, build_tiny_checkpoint

    spec = TinyModelSpec(hidden=a.hidden, layers=a.layers, heads=a.hidden // 64, kv_heads=max(1, a.hidden // 128),
                         intermediate=3 * a.hidden, vocab=a.vocab, max_position_embeddings=max(2048, a.seq))
    return build_tiny_checkpoint(out, spec)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--hidden", type=int, default=512, help="a multiple of 64 (head_dim 64)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--prompt-len", dest="prompt_len", type=int, default=0,
                    help="leading tokens of each row outside the loss mask (a prompt): the draft loss skips them")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per chunk of the per-loss rows' chunked variant")
    ap.add_argument("--train-chunk", dest="train_chunk", type=int, default=None,
                    help="tokens per chunk of the draft loss in the train steps (megatron.mtp_loss_chunk_size; "
                         "0: one chunk; default: the config's, auto)")
    ap.add_argument("--position-fraction", type=float, default=0.25,
                    help="the cheaper option: draft loss on this fraction of positions (trainer.mtp.loss_position_fraction)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the policies' parameter dtype (bfloat16 is what a GPU run would train in)")
    ap.add_argument("--loss-types", default=",".join(LOSS_TYPES))
    ap.add_argument("--breakdown", action="store_true", help="also time the parts of the MTP-on extra cost")
    ap.add_argument("--quick", action="store_true", help=f"smoke size {QUICK} (explicit flags still win)")
    a = ap.parse_args(argv)
    if a.quick:
        ap.set_defaults(**QUICK)
        a = ap.parse_args(argv)
    for name in ("hidden", "layers", "vocab", "batch", "seq", "chunk", "reps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name}={getattr(a, name)} must be >= 1")
    if a.train_chunk is not None and a.train_chunk < 0:
        ap.error(f"--train-chunk={a.train_chunk} must be >= 0 (0: one chunk)")
    if not 0 <= a.prompt_len < a.seq:
        ap.error(f"--prompt-len={a.prompt_len} must be in [0, --seq)")
    if a.hidden % 64:
        ap.error(f"--hidden={a.hidden} must be a multiple of 64")
    loss_types = [x for x in a.loss_types.split(",") if x]
    unknown = sorted(set(loss_types) - set(LOSS_TYPES))
    if unknown:
        ap.error(f"--loss-types: unknown {unknown}; allowed: {list(LOSS_TYPES)}")
    if a.threads:
        torch.set_num_threads(a.threads)

    from skyrl_mtp.mtp.draft_head import DraftLossSpec, compute_draft_loss, replay_mtp_hidden
    from skyrl_mtp.net import free_port
    from skyrl_mtp.policy.batch_layout import prepare
    from skyrl_mtp.policy.config import PolicyWorkerConfig
    from skyrl_mtp.policy.megatron.optimizers import clip_grad_norm
    from skyrl_mtp.policy.megatron_policy import MegatronPolicy, token_logprobs
    from skyrl_mtp.policy.synthetic_batch import random_dapo_batch

    ckpt = build_checkpoint(Path(tempfile.mkdtemp(prefix="draft_loss_bench_")) / "ckpt", a)
    port = free_port()
    common = dict(micro_batch_size=a.batch, policy_lr=1e-5, head_lr=1e-4, dtype=a.dtype)
    if a.train_chunk is not None:
        common["mtp_loss_chunk_size"] = a.train_chunk
    on = MegatronPolicy(PolicyWorkerConfig(**common), str(ckpt), 0, 1, "127.0.0.1", port)
    off = MegatronPolicy(PolicyWorkerConfig(**common, mtp_enabled=False), str(ckpt), 0, 1, "127.0.0.1", port)
    cheap = MegatronPolicy(PolicyWorkerConfig(**common, mtp_loss_position_fraction=a.position_fraction), str(ckpt),
                           0, 1, "127.0.0.1", port)
    raw = random_dapo_batch(torch.Generator().manual_seed(0), a.batch, a.seq, vocab=a.vocab, prompt_len=a.prompt_len)
    batch = on._on_device(prepare(raw))  # the policies share one device (CUDA when there is one)
    ids, lm = batch["input_ids"], batch["loss_mask"]
    on.model.train()
    off.model.train()

    def policy_fwd_bwd():
        off.model.zero_grad(set_to_none=True)
        logits = off._forward(batch)
        (-(token_logprobs(logits, ids) * lm).sum() / lm.sum()).backward()

    with torch.no_grad():
        teacher = on._forward(batch)
    captured = on.capture.take()

    def draft_fn(spec):
        def run():
            on.model.zero_grad(set_to_none=True)
            res = compute_draft_loss(on.model, captured, teacher, batch, spec, a.vocab)
            (res.loss_sum / res.num_tokens.clamp(min=1)).backward()
        return run

    fns = {"policy": policy_fwd_bwd}
    for lt in loss_types:
        for chunked in (False, True):
            fns[(lt, chunked)] = draft_fn(DraftLossSpec(loss_type=lt, num_depths=1, topk=32,
                                                        chunk_size=a.chunk if chunked else 0))
    times = best_of(fns, a.reps)
    policy_ms, policy_cpu = times["policy"]
    policy_mb = peak_memory_mb(policy_fwd_bwd)
    rows = []
    for key, (ms, cpu) in times.items():
        if key == "policy":
            continue
        mb = peak_memory_mb(fns[key])
        rows.append({"loss_type": key[0], "chunked": key[1], "time_ms": round(ms, 2), "cpu_ms": round(cpu, 2),
                     "peak_mem_mb": round(mb, 1), "ratio_to_policy_fwd_bwd": round(ms / policy_ms, 4),
                     "cpu_ratio_to_policy_fwd_bwd": round(cpu / policy_cpu, 4),
                     "peak_mem_ratio_to_policy": round(mb / policy_mb, 4)})

    steps = best_of({"on": lambda: on.train_step(dict(raw), "dapo", {}),
                     "off": lambda: off.train_step(dict(raw), "dapo", {}),
                     "cheap": lambda: cheap.train_step(dict(raw), "dapo", {})}, a.reps)
    result = {"rows": rows, "train_step_ratio_mtp_on_off": round(steps["on"][0] / steps["off"][0], 4),
              "train_step_cpu_ratio_mtp_on_off": round(steps["on"][1] / steps["off"][1], 4),
              "train_step_ms_mtp_on": round(steps["on"][0], 2), "train_step_ms_mtp_off": round(steps["off"][0], 2),
              "flop_floor_ratio_mtp_on_off": round(flop_floor_ratio(a), 4),
              "position_fraction": a.position_fraction,
              "train_step_ratio_mtp_on_off_cheap": round(steps["cheap"][0] / steps["off"][0], 4),
              "flop_floor_ratio_mtp_on_off_cheap": round(flop_floor_ratio(a, a.position_fraction), 4),
              "policy_fwd_bwd_ms": round(policy_ms, 2), "policy_fwd_bwd_cpu_ms": round(policy_cpu, 2),
              "policy_fwd_bwd_peak_mem_mb": round(policy_mb, 1),
              "device": "cuda" if torch.cuda.is_available() else "cpu", "dtype": a.dtype,
              "threads": torch.get_num_threads(),
              "shape": {k: getattr(a, k) for k in ("hidden", "layers", "vocab", "batch", "seq", "prompt_len", "chunk")},
              "train_chunk": on.cfg.mtp_loss_chunk_size}

    if a.breakdown:
        def replay_only():  # gradients returned, not accumulated: the optimizer parts keep theirs
            h = replay_mtp_hidden(on.model, captured, ids, batch["position_ids"], 1)[0]
            torch.autograd.grad(h.sum(), on.head_params, allow_unused=True)

        def fill(params):
            for p in params:
                p.grad = torch.full_like(p, 1e-3)

        def head_opt():
            clip_grad_norm(on.head_params, on.cfg.head_grad_clip)
            on.head_opt.step()

        def policy_opt():
            clip_grad_norm(on.policy_params, on.cfg.policy_grad_clip)
            on.policy_opt.step()

        fill(on.head_params)
        fill(on.policy_params)
        parts = best_of({"replay_fwd_bwd": replay_only, "head_clip_and_step": head_opt,
                         "policy_clip_and_step": policy_opt}, a.reps)
        soft = times[("soft_ce", False)] if ("soft_ce", False) in times else None
        result["breakdown_ms"] = {k: round(v[0], 2) for k, v in parts.items()}
        result["breakdown_ms"]["policy_fwd_bwd"] = round(policy_ms, 2)
        if soft is not None:
            result["breakdown_ms"]["soft_ce_draft_fwd_bwd"] = round(soft[0], 2)
            result["breakdown_ms"]["soft_ce_projection_and_loss"] = round(soft[0] - parts["replay_fwd_bwd"][0], 2)
        result["head_params"] = sum(p.numel() for p in on.head_params)
        result["policy_params"] = sum(p.numel() for p in on.policy_params)
    on.capture.remove()
    print(json.dumps(result, indent=2))
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
