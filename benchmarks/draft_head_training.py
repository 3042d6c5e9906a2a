"""What the head-training options buy in acceptance, measured by vLLM on the heads they produce.

Why it exists: the draft loss has options (depths trained, loss type, a subset of positions) and vLLM has
two ways to draft (greedy or probabilistic); only the acceptance a served head reaches says which pays.
Targets (`--target`): "bigram" is the oracle target of `rollout_spec.py` (the next token depends on the
current one only; its exact MTP head is known and served as the reference row), its MTP head re-initialised
at random; "trigram" (the tiny factory's head="trigram") makes the next token depend on the last two, so a
draft at depth d needs the token before the one it is given, which only the hidden state the head passes
itself carries: the target where training depths 2..k can matter. Its fresh MTP head is served untrained as
the floor row. The head is trained with the project's decoupled draft loss (MegatronPolicy, policy learning
rate 0) on sequences the target itself sampled at T = 1, once per variant with the same data and steps.
Each trained head is served by vLLM with k drafts at T = 1 on held-out prompts, and the per-position
acceptance is read from vLLM's own counters.

Variants (name: depths trained, loss, fraction of positions, depth decay): depth1 (1, soft_ce, 1.0, -),
depth_aware (k, soft_ce, 1.0, 1.0: every depth alike), depth_decay (k, soft_ce, 1.0, each of --depth-decays;
depth d's loss weighs decay ** (d - 1), trainer.mtp.loss_depth_decay), tv (k, tv, 1.0, --decay), subset
(k, soft_ce, --subset-fraction, --decay); --decay defaults to trainer.mtp.loss_depth_decay's default.
Served with greedy drafts, and all but subset also with probabilistic drafts (depth-1 vs depth-aware where
the drafts are not capped by the target's top token; greedy + soft CE vs probabilistic + TV).
`--save-trained DIR` keeps the depth_aware checkpoint (rollout_spec.py --trained-ckpt serves it).

    python benchmarks/draft_head_training.py [--target bigram|trigram] [--steps 100] [--k 3] [--json OUT] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# --quick: a smoke size (small model, few steps, few sequences); explicit flags still win
QUICK = dict(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=384, vocab=1024, steps=4, train_seqs=16,
             eval_prompts=4, max_tokens=12, batch=8, variants="depth1")
VARIANT_NAMES = ("depth1", "depth_aware", "depth_decay", "tv", "subset")
TARGETS = ("bigram", "trigram")


def variants(k: int, subset_fraction: float, names: str = ",".join(VARIANT_NAMES),
             decays: tuple[float, ...] = (0.5,), decay: float = 1.0) -> list[dict]:
    chosen = names.split(",")
    return [v for v in _all_variants(k, subset_fraction, decays, decay) if v["kind"] in chosen]


def _all_variants(k: int, subset_fraction: float, decays: tuple[float, ...], decay: float) -> list[dict]:
    # depth1 is served with probabilistic drafts too: greedy acceptance at T = 1 is capped by the target's
    # top-token probability for any head whose argmax matches, so only sampled drafts show what depths 2..k
    # lose when the head never trained on its own depth-1 output
    both = ["greedy", "probabilistic"]
    out = [dict(kind="depth1", depths=1, loss="soft_ce", fraction=1.0, decay=1.0, drafts=both),
           dict(kind="depth_aware", depths=k, loss="soft_ce", fraction=1.0, decay=1.0, drafts=both)]
    out += [dict(kind="depth_decay", depths=k, loss="soft_ce", fraction=1.0, decay=x, drafts=both) for x in decays]
    out += [dict(kind="tv", depths=k, loss="tv", fraction=1.0, decay=decay, drafts=both),
            dict(kind="subset", depths=k, loss="soft_ce", fraction=subset_fraction, decay=decay, drafts=["greedy"])]
    for v in out:
        v["name"] = f"depth_decay={v['decay']:g}" if v["kind"] == "depth_decay" else v["kind"]
    return out


def random_head_copy(oracle: Path, random_ckpt: Path, out: Path) -> Path:
    """The oracle checkpoint with its MTP tensors replaced by the random checkpoint's (same shapes)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(oracle, out)
    sd = load_file(str(oracle / "model.safetensors"))
    rnd = load_file(str(random_ckpt / "model.safetensors"))
    replaced = [n for n in sd if n.startswith("model.mtp_layers.")]
    if not replaced:
        raise SystemExit(f"{oracle}: no model.mtp_layers.* tensors (expected the MiMo layout)")
    for n in replaced:
        sd[n] = rnd[n].clone()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def sample_sequences(ckpt: Path, prompts: list[list[int]], max_tokens: int, seed: int) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(ckpt), max_model_len=len(prompts[0]) + max_tokens + 16, max_num_seqs=64,
              kv_cache_memory_bytes=128 * 2**20, enforce_eager=True, dtype="float32", seed=0)
    try:
        params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed + i)
                  for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


def train_head(start: Path, seqs: list[list[int]], prompt_len: int, v: dict, a, out: Path) -> dict:
    import torch

    from skyrl_mtp.net import free_port
    from skyrl_mtp.policy.config import PolicyWorkerConfig
    from skyrl_mtp.policy.megatron_policy import MegatronPolicy

    cfg = PolicyWorkerConfig(policy_lr=0.0, head_lr=a.lr, micro_batch_size=a.batch, seed=0, mtp_num_depths=v["depths"],
                             mtp_loss_type=v["loss"], mtp_loss_position_fraction=v["fraction"],
                             mtp_loss_depth_decay=v["decay"], head_grad_clip=1.0, export_hf=True, export_draft_head=False)
    policy = MegatronPolicy(cfg, str(start), 0, 1, "127.0.0.1", free_port())
    ids = torch.tensor(seqs, dtype=torch.long)
    loss_mask = torch.zeros_like(ids, dtype=torch.float32)
    loss_mask[:, prompt_len:] = 1.0
    g = torch.Generator().manual_seed(0)   # the same mini-batches for every variant
    t0, last = time.perf_counter(), {}
    for _ in range(a.steps):
        idx = torch.randperm(len(seqs), generator=g)[: a.batch]
        last = policy.train_step({"input_ids": ids[idx], "attention_mask": torch.ones_like(ids[idx]),
                                  "loss_mask": loss_mask[idx]}, policy_loss="sft")
    seconds = time.perf_counter() - t0
    policy._export_hf_streaming(str(out))
    policy.shutdown()
    return {"train_s": seconds, "mtp_loss": last.get("mtp/loss"),
            "top1_agreement_per_depth": [last.get(f"mtp/top1_agreement_pos_{d}") for d in range(1, v["depths"] + 1)]}


def acceptance(ckpt: Path, prompts: list[list[int]], k: int, draft: str, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    from skyrl_mtp.rollout.config import EngineConfig
    from skyrl_mtp.rollout.engine import WORKER_EXTENSION_CLS
    from skyrl_mtp.rollout.spec_metrics import counters_from_vllm_metrics

    spec = EngineConfig(model_path=str(ckpt), num_speculative_tokens=k, draft_sample_method=draft).speculative_config
    llm = LLM(model=str(ckpt), max_model_len=len(prompts[0]) + max_tokens + 16, max_num_seqs=64,
              kv_cache_memory_bytes=128 * 2**20, enforce_eager=True, dtype="float32", seed=0,
              disable_log_stats=False, worker_extension_cls=WORKER_EXTENSION_CLS, speculative_config=spec)
    try:
        params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=10_000 + i)
                  for i in range(len(prompts))]
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        c = counters_from_vllm_metrics(llm.get_metrics())
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    drafts = max(c.num_drafts, 1.0)
    return {"acceptance_rate": c.num_accepted_tokens / max(c.num_draft_tokens, 1.0),
            "mean_acceptance_length": 1.0 + c.num_accepted_tokens / drafts,
            "acceptance_per_pos": [x / drafts for x in c.accepted_per_pos]}


def main(argv: list[str] | None = None) -> int:
    from skyrl_mtp.config.schema import MTPConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--target", choices=TARGETS, default="bigram",
                    help="bigram: the oracle target (reference row: its exact head); trigram: the next token "
                         "depends on the last two (reference row: the untrained head)")
    ap.add_argument("--k", type=int, default=3, help="drafts served; the depth-aware variants train depths 1..k")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16, help="sequences per head-training step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--subset-fraction", type=float, default=0.25)
    ap.add_argument("--depth-decays", default="0.5",
                    help="comma list: one depth_decay variant per value in (0, 1] (trainer.mtp.loss_depth_decay)")
    ap.add_argument("--decay", type=float, default=MTPConfig().loss_depth_decay,
                    help="trainer.mtp.loss_depth_decay of the tv and subset variants (default: the run default)")
    ap.add_argument("--train-seqs", type=int, default=256)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--cache", default=str(REPO / ".cache" / "bench_tiny"))
    ap.add_argument("--variants", default=",".join(VARIANT_NAMES), help=f"comma list of {VARIANT_NAMES}")
    ap.add_argument("--save-trained", default=None, help="copy the depth_aware checkpoint here")
    ap.add_argument("--quick", action="store_true", help=f"smoke size {QUICK} (explicit flags still win)")
    a = ap.parse_args(argv)
    if a.quick:
        ap.set_defaults(**QUICK)
        a = ap.parse_args(argv)
    if not a.variants or any(n not in VARIANT_NAMES for n in a.variants.split(",")):
        ap.error(f"--variants={a.variants!r} is invalid; allowed: a comma list of {VARIANT_NAMES}")
    if a.save_trained and "depth_aware" not in a.variants.split(","):
        ap.error("--save-trained keeps the depth_aware head: add depth_aware to --variants")
    if a.k < 1 or a.steps < 1 or not 0.0 < a.subset_fraction <= 1.0:
        ap.error(f"--k={a.k} and --steps={a.steps} must be >= 1, --subset-fraction={a.subset_fraction} in (0, 1]")
    try:
        decays = tuple(float(x) for x in a.depth_decays.split(","))
    except ValueError:
        decays = ()
    if not decays or not all(0.0 < x <= 1.0 for x in decays) or len(set(decays)) != len(decays):
        ap.error(f"--depth-decays={a.depth_decays!r} is invalid; allowed: a comma list of distinct values in (0, 1]")
    if not 0.0 < a.decay <= 1.0:
        ap.error(f"--decay={a.decay} is invalid; allowed: (0, 1]")

    from skyrl_mtp.runtime_env import configure_offline_caches

    configure_offline_caches(os.environ.get("SKYRL_MTP_CACHE", REPO / ".cache"))
    import torch

    from skyrl_mtp.models.tiny import TinyModelSpec, cached_tiny_checkpoint

    shape = dict(hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads, intermediate=a.intermediate,
                 vocab=a.vocab, mtp_layers=1, seed=0)
    if a.target == "bigram":
        target = cached_tiny_checkpoint(a.cache, TinyModelSpec(head="oracle", **shape))
        random_ckpt = cached_tiny_checkpoint(a.cache, TinyModelSpec(head="random", **shape))
    else:
        target = cached_tiny_checkpoint(a.cache, TinyModelSpec(head="trigram", **shape))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, min(a.vocab, 4000), (a.prompt_len,), generator=g).tolist()
               for _ in range(a.train_seqs + a.eval_prompts)]
    train_prompts, eval_prompts = prompts[: a.train_seqs], prompts[a.train_seqs:]

    rows = []
    with tempfile.TemporaryDirectory(prefix="draft_head_training_") as tmp:
        tmp = Path(tmp)
        start = random_head_copy(target, random_ckpt, tmp / "start") if a.target == "bigram" else target
        t0 = time.perf_counter()
        seqs = sample_sequences(target, train_prompts, a.max_tokens, seed=1)
        print(f"sampled {len(seqs)} target sequences in {time.perf_counter() - t0:.1f}s", flush=True)
        trained, chosen = {}, variants(a.k, a.subset_fraction, a.variants, decays, a.decay)
        for v in chosen:
            out = tmp / v["name"]
            info = train_head(start, seqs, a.prompt_len, v, a, out)
            trained[v["name"]] = (out / "hf", info)
            print(f"trained {v['name']}: {info['train_s']:.1f}s, agreement per depth "
                  f"{[round(x, 3) for x in info['top1_agreement_per_depth'] if x is not None]}", flush=True)
        reference = ("oracle", None, target, "greedy") if a.target == "bigram" else (
            "untrained", None, start, "probabilistic")
        evals = [reference] + [(v["name"], v, trained[v["name"]][0], d) for v in chosen for d in v["drafts"]]
        for name, v, ckpt, draft in evals:
            r = acceptance(ckpt, eval_prompts, a.k, draft, a.max_tokens)
            info = trained[name][1] if v else {}
            rows.append({"variant": name, "train_depths": v["depths"] if v else None,
                         "loss_type": v["loss"] if v else None, "position_fraction": v["fraction"] if v else None,
                         "depth_decay": v["decay"] if v and v["depths"] > 1 else None,
                         "draft_sample_method": draft, "k": a.k, "temperature": 1.0, "steps": a.steps if v else 0,
                         **r, "train_s": info.get("train_s"), "mtp_loss": info.get("mtp_loss"),
                         "top1_agreement_per_depth": info.get("top1_agreement_per_depth")})
            print(f"{name} ({draft}): acceptance {r['acceptance_rate']:.3f} per pos "
                  f"{[round(x, 3) for x in r['acceptance_per_pos']]}", flush=True)
        if a.save_trained:
            shutil.copytree(trained["depth_aware"][0], a.save_trained, dirs_exist_ok=True)

    oracle_rate = rows[0]["acceptance_rate"] if a.target == "bigram" else None
    print(f"\ntarget: {a.target} model hidden={a.hidden} layers={a.layers} vocab={a.vocab}; head trained "
          f"{a.steps} steps x {a.batch} sequences of {a.max_tokens} sampled tokens; served k={a.k}, T=1")
    print(f"{'variant':>16} {'depths':>6} {'loss':>8} {'frac':>5} {'decay':>5} {'drafts':>13} {'accept':>7} "
          f"{'vs_oracle':>9} {'mean_len':>8} per-position")
    for r in rows:
        r["target"] = a.target
        r["acceptance_vs_oracle"] = r["acceptance_rate"] / oracle_rate if oracle_rate else None
        vs = "-" if r["acceptance_vs_oracle"] is None else f"{r['acceptance_vs_oracle']:.3f}"
        print(f"{r['variant']:>16} {str(r['train_depths'] or '-'):>6} {str(r['loss_type'] or '-'):>8} "
              f"{str(r['position_fraction'] or '-'):>5} {str(r['depth_decay'] or '-'):>5} "
              f"{r['draft_sample_method']:>13} {r['acceptance_rate']:>7.3f} {vs:>9} {r['mean_acceptance_length']:>8.2f} "
              f"{[round(x, 3) for x in r['acceptance_per_pos']]}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
