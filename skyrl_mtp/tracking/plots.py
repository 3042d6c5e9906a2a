"""PNG plots of a run's metrics.jsonl (reward, per-position acceptance, acceptance length, losses).

Per-step RL metrics are noisy (a few prompts per step), so a series with more than SMOOTH_MIN_POINTS
points is drawn faintly with its trailing moving average on top.
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from skyrl_mtp.tracking.tracker import read_metrics  # noqa: E402

PLOTS = {
    "reward.png": re.compile(r"^(eval/)?reward/mean$"),
    "acceptance_per_position.png": re.compile(r"acceptance.*pos"),
    "mean_acceptance_length.png": re.compile(r"acceptance_length"),
    "losses.png": re.compile(r"loss$"),
}


# plots whose series have different scales (the policy loss is ~0, the draft loss a few nats): one axis each
OWN_AXES = ("losses.png",)

SMOOTH_MIN_POINTS = 20
SMOOTH_WINDOW = 10


def moving_average(ys: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` points (fewer at the start)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def write_plots(metrics_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write each plot whose metrics exist; returns the written paths."""
    rows = read_metrics(metrics_path)
    keys = sorted({k for r in rows for k in r if k != "step"})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, pat in PLOTS.items():
        sel = [k for k in keys if pat.search(k)]
        if not sel:
            continue
        own = name in OWN_AXES and len(sel) > 1
        fig, axes = plt.subplots(len(sel) if own else 1, 1, figsize=(6, 2.5 * len(sel) if own else 4),
                                 sharex=True, squeeze=False)
        for i, k in enumerate(sel):
            ax = axes[i if own else 0][0]
            xs, ys = _series(rows, k)
            if len(xs) > SMOOTH_MIN_POINTS:
                line, = ax.plot(xs, ys, alpha=0.3, linewidth=1)
                ax.plot(xs, moving_average(ys, SMOOTH_WINDOW), color=line.get_color(),
                        label=f"{k} ({SMOOTH_WINDOW}-step mean)")
            else:
                ax.plot(xs, ys, marker="o", label=k)
            ax.legend(fontsize=7)
        axes[-1][0].set_xlabel("step")
        axes[0][0].set_title(name.removesuffix(".png").replace("_", " "))
        fig.tight_layout()
        fig.savefig(out / name, dpi=80)
        plt.close(fig)
        written.append(out / name)
    return written
