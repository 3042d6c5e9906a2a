"""Rollout throughput with and without speculative decoding (vLLM, same engine build, same prompts).

Why it exists: speculative decoding only pays when drafts are accepted AND drafting is cheap next to the
target forward. This measures both ends: an oracle MTP head (drafts always accepted: the upper bound)
and a random head (drafts never accepted: the lower bound, the pure cost of speculating), for k = 1..3,
against no speculative decoding, on a model big enough that CPU decoding is not pure per-step overhead.
Trained drafters are measured the same way, side by side: an RL run's MTP head (`--draft-heads trained
--trained-ckpt RUN/checkpoints/step_N`) and an RL run's EAGLE-3 or DFlash drafter (`--draft-heads eagle3 dflash
--eagle3-ckpt RUN/checkpoints/step_N --dflash-ckpt ...`: the target in hf/, the drafter in draft_head/; without
one, the tiny Llama and a fresh drafter, untrained); `--task-prompts` serves the arithmetic task's held-out questions
through the checkpoint's chat template (what the runs trained on) instead of random token ids.

Every head gets one engine per k (and a no-spec one: the checkpoints' trunks differ), all alive at once;
at every batch size in turn (--batches; max_num_seqs is the largest) they are timed round-robin, one
rollout each per round, the order rotated every round. k = "auto" is adaptive speculation
(speculation/policy.py: k per engine step from the running batch, live acceptance and
on-engine timings, up to --auto-max); its row carries the mean k it chose (`k_mean`), measured once the
engine has timed the batch's bucket at every k (an RL run pays that once per engine: the warm-up repeats
until it has). Every row says whether its tokens equal its head's no-spec engine's
(`identical_to_no_spec`, greedy: must be true). Generation ignores EOS so every configuration emits the
same number of tokens. Each engine's `tokens_per_s` is from its fastest rollout, and `speedup_vs_no_spec`
is the ratio of the two fastest rollouts (this engine's and its head's no-spec engine's, from the same
rounds): on a shared machine a busy moment only ever adds time, it comes in bursts shorter than a round,
and it hits some rollouts of a round and not others, so the fastest of several interleaved rollouts is
what the engine costs (engines timed one after another differed by up to 25% at identical work).
`speedup_per_rep` keeps the ratio of every round, to show the spread, and `speedup_median_of_rounds` is
their median (a second reading of the same rounds: where a few short rollouts decide the fastest, as at
batch 1, the two can differ by more than the effects measured; more --reps narrows both).

Predicted speedup = (1 + sum_i acceptance_pos_i) / (1 + k * c): tokens per target step over the cost
of one step (verify ~ one target forward, plus k draft forwards). c, the cost of one draft forward
relative to a target forward, is estimated from parameter counts (MTP layer + shared lm_head over the
trunk + lm_head, matmul FLOPs per token); the measured lower bound shows how good that estimate is.

    python benchmarks/rollout_spec.py [--json OUT] [--ks 1 2 3 auto] [--batches 1 16 64] [--max-tokens 64]
    python benchmarks/rollout_spec.py --draft-heads trained eagle3 dflash --trained-ckpt MTP_RUN/checkpoints/step_100 \
        --eagle3-ckpt EAGLE3_RUN/checkpoints/step_100 --dflash-ckpt DFLASH_RUN/checkpoints/step_100 --task-prompts --ks 2
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
EXTERNAL = ("eagle3", "dflash")   # external drafter heads (drafters/kinds.py)
QUICK = dict(draft_heads=["oracle", "eagle3"], ks=["auto"], batches=[2], prompt_len=8, max_tokens=16, reps=1,
             hidden=128, layers=2, heads=2, kv_heads=1, intermediate=384, vocab=1024)


def draft_cost_ratio(spec) -> float:
    """Matmul parameters touched per token by one MTP draft step over one target step (tiny MiMo layout)."""
    h, i, v = spec.hidden, spec.intermediate, spec.vocab
    d = spec.head_dim
    block = h * spec.heads * d * 2 + h * spec.kv_heads * d * 2 + 3 * h * i
    lm_head = v * h
    return (block + 2 * h * h + lm_head) / (spec.layers * block + lm_head)


def spec_of(hf: dict):
    """The fields draft_cost_ratio reads, from a checkpoint's config.json."""
    from types import SimpleNamespace

    heads = hf["num_attention_heads"]
    return SimpleNamespace(hidden=hf["hidden_size"], intermediate=hf["intermediate_size"], vocab=hf["vocab_size"],
                           heads=heads, kv_heads=hf.get("num_key_value_heads") or heads, layers=hf["num_hidden_layers"],
                           head_dim=hf.get("head_dim") or hf["hidden_size"] // heads)


def external_cost_ratio(target: dict, drafter: dict) -> float:
    """The same ratio for an external drafter's token, from the two config.json files: EAGLE-3 (fc over three hidden
    states, one layer whose q/k/v read 2H) or DFlash (fc over its target layers, its layers; the block's k + 1
    tokens each cost this), each with the shared lm_head, over one target token."""
    h, f, v = target["hidden_size"], target["intermediate_size"], target["vocab_size"]
    a, g = target["num_attention_heads"], target.get("num_key_value_heads") or target["num_attention_heads"]
    d = target.get("head_dim") or h // a
    block = h * a * d * 2 + h * g * d * 2 + 3 * h * f
    da, dg = drafter["num_attention_heads"], drafter["num_key_value_heads"]
    dd, df = drafter["head_dim"], drafter["intermediate_size"]
    if "dflash_config" in drafter:
        n_in = len(drafter["dflash_config"]["target_layer_ids"])
        draft = n_in * h * h + drafter["num_hidden_layers"] * (2 * h * (da + dg) * dd + 3 * h * df) + v * h
    else:
        draft = 3 * h * h + 2 * h * (da + 2 * dg) * dd + da * dd * h + 3 * h * df + v * h
    return draft / (target["num_hidden_layers"] * block + v * h)


def task_prompts(model_dir: str, n: int) -> list[list[int]]:
    """The arithmetic task's held-out questions, through the checkpoint's chat template, as an RL run encodes them."""
    from transformers import AutoTokenizer

    from skyrl_mtp.data.arithmetic_task import ArithmeticTaskConfig, generate_rows
    from skyrl_mtp.envs.environments import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = generate_rows(ArithmeticTaskConfig(num_train=0, num_test=max(n, 32), seed=1))["test"]
    return [encode_prompt(tokenizer, r["prompt"]) for r in rows[:n]]


def worker_spin_seconds() -> float:
    """How long a vLLM worker process keeps spinning on its message queue after its last message
    (shm_broadcast.SpinCondition's `busy_loop_s`, the default every queue uses)."""
    import inspect

    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    param = inspect.signature(SpinCondition.__init__).parameters.get("busy_loop_s")
    if param is None or not isinstance(param.default, (int, float)):
        raise RuntimeError("vLLM's SpinCondition has no numeric busy_loop_s default any more: rollout_spec.py "
                           "needs another way to know when an engine's worker has gone idle")
    return float(param.default)


def _serve(conn, llm_kwargs: dict, adaptive: bool, cache: str) -> None:
    """The engine process: build the engine, then answer the driver's calls until "stop"."""
    import traceback

    from skyrl_mtp.runtime_env import configure_offline_caches

    configure_offline_caches(cache)
    from vllm import LLM, SamplingParams

    from skyrl_mtp.rollout.spec_metrics import counters_from_vllm_metrics

    try:
        llm = LLM(**llm_kwargs)
        if adaptive:
            llm.collective_rpc("skyrl_install_adaptive_speculation")
    except Exception:
        conn.send((False, traceback.format_exc()))
        return
    conn.send((True, "ready"))

    def generate(prompts, sampling):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**sampling), use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    request_ids = iter(range(1 << 62))

    def stepped(prompts, samplings):
        """One rollout with a SamplingParams per request, stepped by hand: its wall time, each engine step's
        (requests running, seconds to its output), and each request's tokens."""
        engine, ids = llm.llm_engine, []
        for prompt, sampling in zip(prompts, samplings):
            ids.append(str(next(request_ids)))
            engine.add_request(ids[-1], {"prompt_token_ids": prompt}, SamplingParams(**sampling))
        steps, tokens = [], {}
        t0 = last = time.perf_counter()
        while engine.has_unfinished_requests():
            running = engine.get_num_unfinished_requests()
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
            now = time.perf_counter()
            steps.append((running, now - last))
            last = now
        return last - t0, steps, [tokens[i] for i in ids]

    def policy_stats():
        from skyrl_mtp.speculation.scheduler_hook import STATS_UTILITY

        return llm.llm_engine.engine_core.call_utility(STATS_UTILITY)

    calls = {"generate": generate, "stepped": stepped, "counters": lambda: counters_from_vllm_metrics(llm.get_metrics()),
             "worker_spin_seconds": worker_spin_seconds, "adaptive_stats": policy_stats}
    while True:
        method, args = conn.recv()
        if method == "stop":
            llm.llm_engine.engine_core.shutdown()
            conn.send((True, None))
            return
        try:
            conn.send((True, calls[method](*args)))
        except Exception:
            conn.send((False, traceback.format_exc()))


class EngineProcess:
    """One vLLM engine in a process of its own, driven over a pipe.

    Several engines of one process share vLLM's Prometheus registry (a new engine unregisters the previous
    one's spec-decode counters), and an RL run gives each engine its own process (a Ray actor) as well."""

    def __init__(self, llm_kwargs: dict, adaptive: bool, cache: str):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.adaptive = adaptive
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, llm_kwargs, adaptive, cache), daemon=False)
        self._proc.start()
        self._ready = False

    def _reply(self):
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"engine process failed:\n{value}")
        return value

    def wait_ready(self) -> None:
        if not self._ready:
            self._reply()
            self._ready = True

    def call(self, method: str, *args):
        self.wait_ready()
        self._conn.send((method, args))
        return self._reply()

    def close(self) -> None:
        try:
            if self._proc.is_alive() and self._ready:
                self.call("stop")
        finally:
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout=10)


def warm_up(engine: EngineProcess, prompts, sampling: dict) -> None:
    """Run the measured batch until its kernel shapes are warm and (auto) the policy has timed the batch's
    bucket at every k: an RL run pays that once per engine, not per rollout."""
    from skyrl_mtp.speculation.policy import bucket, bucket_label

    engine.call("generate", prompts, sampling)
    for _ in range(16 if engine.adaptive else 0):
        if None not in engine.call("adaptive_stats")["bucket_cost_ratio"].get(bucket_label(bucket(len(prompts))), [None]):
            break
        engine.call("generate", prompts, sampling)


def measure_interleaved(engines: dict, prompts, sampling: dict, reps: int, settle_s: float) -> dict:
    """Time every engine `reps` times, one rollout each per round, the round's order rotated.

    Engines measured one after another see different moments of a shared machine (a busy minute moves a
    whole row); interleaved, every round holds one rollout of each, so per-round ratios against the
    no-spec engine cancel what the machine did in that round. Every engine's worker is bound to the same
    core, and after its last step it keeps spinning on its message queue for a while (worker_spin_seconds):
    each rollout, the warm-ups included (the auto engine calibrates its cost model there), waits `settle_s`
    so that it never shares the core with the previous engine's spinning worker."""
    keys = list(engines)
    for engine in engines.values():
        time.sleep(settle_s)
        warm_up(engine, prompts, sampling)
    before = {key: (e.call("counters"), e.call("adaptive_stats") if e.adaptive else None) for key, e in engines.items()}
    times: dict = {key: [] for key in keys}
    tokens: dict = {}
    for rep in range(reps):
        for key in keys[rep % len(keys):] + keys[:rep % len(keys)]:
            time.sleep(settle_s)
            dt, tokens[key] = engines[key].call("generate", prompts, sampling)
            times[key].append(dt)
    result = {}
    for key, engine in engines.items():
        c0, st0 = before[key]
        delta = engine.call("counters") - c0
        st1 = engine.call("adaptive_stats") if engine.adaptive else None
        drafts, per_pos = delta.num_drafts, delta.accepted_per_pos
        result[key] = {
            "times": times[key],
            "tokens_per_s": sum(map(len, tokens[key])) / min(times[key]),
            "acceptance_rate": delta.num_accepted_tokens / delta.num_draft_tokens if delta.num_draft_tokens else None,
            "mean_acceptance_length": 1 + delta.num_accepted_tokens / drafts if drafts else None,
            "per_pos": [x / drafts for x in per_pos] if drafts else [],
            "token_ids": tokens[key],
            "k_mean": ((st1["k_sum"] - st0["k_sum"]) / (st1["steps"] - st0["steps"])
                       if st1 and st1["steps"] > st0["steps"] else None),
        }
    return result


def paired_speedup(times: list[float], no_spec_times: list[float]) -> list[float]:
    """Per-round speedups: the no-spec rollout's time over this engine's, both from the same round."""
    if len(times) != len(no_spec_times):
        raise ValueError(f"unpaired rounds: {len(times)} vs {len(no_spec_times)} timings")
    return [t0 / t for t, t0 in zip(times, no_spec_times)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write {'rows': [...]} here")
    ap.add_argument("--ks", nargs="+", default=["1", "2", "3", "auto"], help="ints >= 1 and/or auto")
    ap.add_argument("--auto-max", type=int, default=3, help="the maximum k of the auto rows")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--draft-heads", nargs="+", default=["oracle", "random"],
                    choices=["oracle", "random", "trained", *EXTERNAL],
                    help="trained: the MTP head in --trained-ckpt; eagle3 / dflash: the drafter of --eagle3-ckpt / "
                         "--dflash-ckpt")
    ap.add_argument("--trained-ckpt", default=None,
                    help="an HF checkpoint with a trained MTP head (benchmarks/draft_head_training.py --save-trained), "
                         "or an RL run's checkpoint directory (its hf/)")
    for kind in EXTERNAL:
        ap.add_argument(f"--{kind}-ckpt", default=None,
                        help=f"an RL run's checkpoint directory with hf/ (the target) and draft_head/ (its {kind} "
                             "drafter); default: the tiny Llama of this shape and a fresh, untrained drafter")
    ap.add_argument("--task-prompts", action="store_true",
                    help="the arithmetic task's held-out questions (chat template of each checkpoint) as prompts")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds (rollouts per engine and batch)")
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
    if a.trained_ckpt and (Path(a.trained_ckpt) / "hf" / "config.json").is_file():
        a.trained_ckpt = str(Path(a.trained_ckpt) / "hf")   # an RL run's checkpoint: its HF export
    if "trained" in a.draft_heads and not (a.trained_ckpt and (Path(a.trained_ckpt) / "config.json").is_file()):
        ap.error(f"--draft-heads trained needs --trained-ckpt (an HF checkpoint directory); got {a.trained_ckpt!r}")
    for kind in EXTERNAL:
        ckpt = getattr(a, f"{kind}_ckpt")
        if ckpt and not all((Path(ckpt) / d / "config.json").is_file() for d in ("hf", "draft_head")):
            ap.error(f"--{kind}-ckpt={ckpt!r} is invalid: expected an RL run's checkpoint directory with hf/ and "
                     f"draft_head/ (trainer.drafter.kind={kind})")
    if a.auto_max < 1 or any(b < 1 for b in a.batches):
        ap.error(f"--auto-max={a.auto_max} and --batches={a.batches} must be >= 1")
    a.ks = [k if k == "auto" else int(k) for k in a.ks]

    from skyrl_mtp.runtime_env import configure_offline_caches

    cache = str(os.environ.get("SKYRL_MTP_CACHE", REPO / ".cache"))
    configure_offline_caches(cache)
    import torch

    from skyrl_mtp.models.tiny import TinyModelSpec, cached_tiny_checkpoint
    from skyrl_mtp.rollout.config import EngineConfig
    from skyrl_mtp.rollout.engine import WORKER_EXTENSION_CLS

    shape = dict(hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                 intermediate=a.intermediate, vocab=a.vocab, mtp_layers=1, seed=0)
    oracle = cached_tiny_checkpoint(a.cache, TinyModelSpec(head="oracle", **shape))
    random_ckpt = cached_tiny_checkpoint(a.cache, TinyModelSpec(head="random", **shape))
    c = draft_cost_ratio(TinyModelSpec(**shape))

    targets = {"random": (str(random_ckpt), None), "oracle": (str(oracle), None), "trained": (a.trained_ckpt, None),
               **{kind: external_target(a, kind, shape) for kind in EXTERNAL if kind in a.draft_heads}}
    g = torch.Generator().manual_seed(0)
    random_prompts = [torch.randint(10, 200, (a.prompt_len,), generator=g).tolist() for _ in range(max(a.batches))]
    sampling = dict(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True, logprobs=1)
    prompt_len = max(len(p) for p in task_prompts(targets[a.draft_heads[0]][0], 1)) + 16 if a.task_prompts \
        else a.prompt_len
    base = dict(max_model_len=prompt_len + a.max_tokens + 16, max_num_seqs=max(a.batches),
                kv_cache_memory_bytes=128 * 2**20, enforce_eager=True, dtype="float32", seed=0,
                disable_log_stats=False, worker_extension_cls=WORKER_EXTENSION_CLS)

    rows = []
    for head in a.draft_heads:
        # one engine per k, all alive at once and timed round-robin (k = 0 too: the checkpoints' trunks
        # differ, so each head has its own no-spec reference); the weight sync itself is measured by the
        # trainer (sync/* metrics)
        path, drafter = targets[head]
        prompts = task_prompts(path, max(a.batches)) if a.task_prompts else random_prompts
        if drafter is not None:
            cost = external_cost_ratio(*(json.loads((Path(p) / "config.json").read_text()) for p in (path, drafter)))
        else:   # the MTP head of the checkpoint served (a trained one need not have the benchmark's shape)
            cost = draft_cost_ratio(spec_of(json.loads((Path(path) / "config.json").read_text())))
        # auto k drafts with MTP heads only: an external drafter takes the fixed ks (k = 1 when there are none)
        ks = ([k for k in a.ks if k != "auto"] or [1]) if drafter else a.ks
        engines: dict = {}
        try:
            for k in [0, *ks]:
                eng_cfg = EngineConfig(model_path=path, num_speculative_tokens=a.auto_max if k == "auto" else k,
                                       max_num_seqs=max(a.batches), adaptive_speculation=k == "auto",
                                       draft_model_path=drafter if k else None,
                                       draft_method=head if head in EXTERNAL else "eagle3")
                managed = eng_cfg.managed_engine_kwargs(WORKER_EXTENSION_CLS)
                sched = {key: managed[key] for key in ("scheduler_cls", "async_scheduling", "additional_config")
                         } if k == "auto" else {}
                engines[k] = EngineProcess({**base, "model": path, **sched, "speculative_config": eng_cfg.speculative_config},
                                           adaptive=k == "auto", cache=cache)
            settle_s = engines[0].call("worker_spin_seconds") + 0.25   # one vLLM install: the same for all
            for batch in a.batches:
                measured = measure_interleaved(engines, prompts[:batch], sampling, a.reps, settle_s)
                ref = measured[0]
                for k, r in measured.items():
                    per_rep = paired_speedup(r["times"], ref["times"])
                    speedup = min(ref["times"]) / min(r["times"])
                    predicted = (1 + sum(r["per_pos"])) / (1 + k * cost) if isinstance(k, int) and k else (
                        1.0 if not k else None)
                    rows.append({"head": head, "k": k, "batch": batch, "draft_cost_ratio": cost,
                                 "tokens_per_s": r["tokens_per_s"],
                                 "no_spec_tokens_per_s": ref["tokens_per_s"],
                                 "acceptance_rate": r["acceptance_rate"],
                                 "mean_acceptance_length": r["mean_acceptance_length"],
                                 "acceptance_per_pos": r["per_pos"], "k_mean": r["k_mean"],
                                 "speedup_vs_no_spec": speedup,
                                 "speedup_per_rep": per_rep, "speedup_median_of_rounds": statistics.median(per_rep),
                                 "predicted_speedup": predicted,
                                 "identical_to_no_spec": r["token_ids"] == ref["token_ids"]})
                    print(f"k={k} head={head} batch={batch}: {r['tokens_per_s']:.1f} tok/s, "
                          f"speedup {speedup:.2f}x", flush=True)
        finally:
            for engine in engines.values():
                engine.close()

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    print(f"\nmodel: hidden={a.hidden} layers={a.layers} heads={a.heads}/{a.kv_heads} vocab={a.vocab} fp32 (oracle / "
          f"random heads; trained and external ones: their checkpoints'); prompts: "
          f"{'the arithmetic task' if a.task_prompts else f'{a.prompt_len} random tokens'}; max_tokens={a.max_tokens} "
          f"(greedy, EOS ignored); draft cost ratio c={c:.3f} for the oracle / random heads (parameter estimate; each "
          "row's own in the JSON)")
    print(f"{'head':>7} {'k':>5} {'batch':>5} {'tok/s':>8} {'accept':>7} {'mean_len':>8} {'k_mean':>6} {'speedup':>8} "
          f"{'per-round range':>15} {'median':>6} {'predicted':>9} {'same':>5}")
    for row in rows:
        print(f"{str(row['head']):>7} {str(row['k']):>5} {row['batch']:>5} {row['tokens_per_s']:>8.1f} "
              f"{fmt(row['acceptance_rate'], '.3f'):>7} {fmt(row['mean_acceptance_length'], '.2f'):>8} "
              f"{fmt(row['k_mean'], '.2f'):>6} {row['speedup_vs_no_spec']:>7.2f}x "
              f"{min(row['speedup_per_rep']):>7.2f}-{max(row['speedup_per_rep']):.2f}x "
              f"{row['speedup_median_of_rounds']:>5.2f}x "
              f"{fmt(row['predicted_speedup'], '.2f'):>8}x {str(row['identical_to_no_spec']):>5}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=2))
    return 0


def external_target(a, kind: str, shape: dict) -> tuple[str, str]:
    """(target checkpoint, drafter export) of an external drafter head: --{kind}-ckpt's, or the tiny Llama of the
    benchmark's shape with a fresh drafter (seed 0, untrained; DFlash: one block of the largest k + 1)."""
    ckpt = getattr(a, f"{kind}_ckpt")
    if ckpt:
        return str(Path(ckpt) / "hf"), str(Path(ckpt) / "draft_head")
    from skyrl_mtp.models.tiny import TinyModelSpec, cached_tiny_checkpoint
    from skyrl_mtp.policy.config import PolicyWorkerConfig
    from skyrl_mtp.policy.drafter_training import write_initial_export

    target = cached_tiny_checkpoint(a.cache, TinyModelSpec(family="llama", **{**shape, "mtp_layers": 0}))
    block = max([k for k in a.ks if k != "auto"] + [1]) + 1
    fresh = PolicyWorkerConfig(drafter_kind=kind, mtp_enabled=False, seed=0, drafter_block_size=block)
    return str(target), str(write_initial_export(fresh, target, Path(a.cache) / f"{kind}-b{block}-{target.name}"))


if __name__ == "__main__":
    raise SystemExit(main())
