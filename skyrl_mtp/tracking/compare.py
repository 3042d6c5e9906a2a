"""Are two runs' policies bitwise identical? Their metrics and their latest common checkpoint's trunk.

The isolation check of the decoupled draft loss: the same recipe with `trainer.mtp.loss_weight=1.0`
and `=0.0` (speculative decoding on in both) must agree on every metric that does not depend on the
MTP head (its loss, the draft acceptance counters) at every step, and on every non-MTP tensor of the
HF export bit for bit. With `draft_metrics=True` the head's metrics must agree too: two runs of the same
recipe and seed on two builds of the code (a refactor must change nothing). CLI:
scripts/compare_policy_runs.py.
"""

from __future__ import annotations

import json
from pathlib import Path

# wall-clock metrics (phase timings, throughput, sync and retriever times) never repeat across runs
VOLATILE = ("timing/", "tokens_per_s", "seconds", "latency")
DRAFT_DEPENDENT = ("mtp/", "draft_acceptance_rate", "mean_acceptance_length", "num_drafts", "num_draft_tokens",
                   "num_accepted_tokens")


def policy_metrics(run: Path, draft_metrics: bool = False) -> dict[int, dict]:
    """Every step's metrics but the wall-clock ones (and, unless `draft_metrics`, the head's)."""
    skip = VOLATILE if draft_metrics else VOLATILE + DRAFT_DEPENDENT
    rows = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = {k: v for k, v in row.items() if not any(s in k for s in skip)}
    return rows


def latest_common_checkpoint(a: Path, b: Path) -> str | None:
    def steps(run: Path) -> set[str]:
        return {p.name for p in (run / "checkpoints").glob("step_*") if (p / "COMPLETE").exists()}
    common = steps(a) & steps(b)
    return max(common, key=lambda s: int(s.split("_")[1])) if common else None


def compare_policy_runs(a: Path, b: Path, draft_metrics: bool = False) -> tuple[list[str], dict]:
    from safetensors.torch import load_file

    from skyrl_mtp.models.families import mtp_hf_names

    problems: list[str] = []
    ma, mb = policy_metrics(a, draft_metrics), policy_metrics(b, draft_metrics)
    if sorted(ma) != sorted(mb):
        problems.append(f"steps differ: {sorted(ma)} vs {sorted(mb)}")
    keys_compared = 0
    for step in sorted(set(ma) & set(mb)):
        for key in sorted(set(ma[step]) | set(mb[step])):
            keys_compared += 1
            if ma[step].get(key) != mb[step].get(key):
                problems.append(f"step {step} {key}: {ma[step].get(key)!r} vs {mb[step].get(key)!r}")
    ckpt = latest_common_checkpoint(a, b)
    tensors = 0
    if ckpt is None:
        problems.append("no complete checkpoint in both runs")
    else:
        wa = load_file(str(a / "checkpoints" / ckpt / "hf" / "model.safetensors"))
        wb = load_file(str(b / "checkpoints" / ckpt / "hf" / "model.safetensors"))
        head = mtp_hf_names(wa)
        trunk = sorted(k for k in wa if k not in head)   # every family's MTP layout
        if set(wa) != set(wb):
            problems.append(f"{ckpt}: tensor names differ")
        for name in trunk:
            tensors += 1
            if name not in wb or not wa[name].equal(wb[name]):
                problems.append(f"{ckpt}: {name} differs")
    summary = {"steps": len(set(ma) & set(mb)), "metric_values_compared": keys_compared, "checkpoint": ckpt,
               "trunk_tensors_compared": tensors, "differences": len(problems)}
    return problems, summary
