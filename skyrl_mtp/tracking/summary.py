"""Final run summary: first / last / best value of key metrics from metrics.jsonl as a text table.

Single steps are noisy, so the table also gives the mean over the first and the last tenth of the
points of each metric: that is where a trend shows. Those columns appear once a metric has
TREND_MIN_POINTS points (a tenth of fewer is one point, the first or last value again).
"""

from __future__ import annotations

from pathlib import Path

from skyrl_mtp.tracking.tracker import read_metrics

DEFAULT_KEYS = ("reward/mean", "eval/reward/mean", "policy/loss", "mtp/loss")
TREND_MIN_POINTS = 20


def summarize(metrics_path: str | Path, keys: tuple[str, ...] | None = None) -> dict[str, dict[str, float]]:
    """{key: {first, last, best, best_step, head_mean, tail_mean}}; best = max for reward/acceptance keys, min
    otherwise; head_mean / tail_mean = mean of the first / last max(1, n // 10) points."""
    rows = read_metrics(metrics_path)
    if keys is None:
        keys = tuple(sorted({k for r in rows for k in r if k != "step" and ("acceptance" in k or k in DEFAULT_KEYS)}))
    out = {}
    for k in keys:
        pts = [(r["step"], float(r[k])) for r in rows if isinstance(r.get(k), (int, float))]
        if not pts:
            continue
        higher = "reward" in k or "acceptance" in k or "agree" in k
        best = (max if higher else min)(pts, key=lambda p: p[1])
        tenth = max(1, len(pts) // 10)
        out[k] = {"first": pts[0][1], "last": pts[-1][1], "best": best[1], "best_step": float(best[0]),
                  "points": float(len(pts)),
                  "head_mean": sum(p[1] for p in pts[:tenth]) / tenth,
                  "tail_mean": sum(p[1] for p in pts[-tenth:]) / tenth}
    return out


def format_summary(summary: dict[str, dict[str, float]]) -> str:
    """The table; the first / last 10% columns only when a metric has TREND_MIN_POINTS points ("-" for those
    with fewer)."""
    w = max([len(k) for k in summary] + [6])
    trend = any(s.get("points", 0) >= TREND_MIN_POINTS for s in summary.values())
    head = f"{'metric':<{w}}  {'first':>10}  {'last':>10}  "
    lines = [head + (f"{'first 10%':>10}  {'last 10%':>10}  " if trend else "") + f"{'best':>10}  {'step':>5}"]
    for k, s in summary.items():
        row = f"{k:<{w}}  {s['first']:>10.4g}  {s['last']:>10.4g}  "
        if trend:
            enough = s.get("points", 0) >= TREND_MIN_POINTS
            row += (f"{s['head_mean']:>10.4g}  {s['tail_mean']:>10.4g}  " if enough else f"{'-':>10}  {'-':>10}  ")
        lines.append(row + f"{s['best']:>10.4g}  {int(s['best_step']):>5}")
    return "\n".join(lines)
