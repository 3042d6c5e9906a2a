"""Reward curves of several runs in one PNG: eval reward and train reward against the step, one line per run.

Made to compare how runs learn side by side, e.g. sync against one_step_off with each off-policy correction
(docs/async.md); a run's own plots (logger.plots) show one run only.

    python scripts/plot_reward_curves.py RUN_DIR [RUN_DIR ...] [--out curves.png] [--labels a,b,...]

Each RUN_DIR is a run directory holding metrics.jsonl. The top panel is eval/reward/mean at each evaluation, the
bottom one reward/mean (the mean reward of the step's training batch), drawn faintly with its trailing
moving average on top (skyrl_mtp.tracking.plots). A run keeps one colour in both panels. The script prints
each run's eval reward at its last evaluation (and that evaluation's step), then the range over the runs.
Exit status 2 when a run directory has no metrics.jsonl.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from skyrl_mtp.tracking.plots import SMOOTH_MIN_POINTS, SMOOTH_WINDOW, moving_average  # noqa: E402
from skyrl_mtp.tracking.tracker import read_metrics  # noqa: E402

EVAL_KEY = "eval/reward/mean"
TRAIN_KEY = "reward/mean"


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, in step order, from the rows that log it."""
    pts = sorted((r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float)))
    return [s for s, _ in pts], [v for _, v in pts]


def last_eval(rows: list[dict]) -> tuple[int, float] | None:
    """(step, eval reward) of the run's last evaluation; None when it never evaluated."""
    steps, values = series(rows, EVAL_KEY)
    return (steps[-1], values[-1]) if steps else None


def plot_runs(runs: dict[str, list[dict]], out: Path) -> None:
    fig, (ev, tr) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for label, rows in runs.items():
        xs, ys = series(rows, EVAL_KEY)
        line, = ev.plot(xs, ys, marker="o", label=label)
        xs, ys = series(rows, TRAIN_KEY)
        if len(xs) > SMOOTH_MIN_POINTS:
            tr.plot(xs, ys, color=line.get_color(), alpha=0.25, linewidth=1)
            tr.plot(xs, moving_average(ys, SMOOTH_WINDOW), color=line.get_color(), label=label)
        else:
            tr.plot(xs, ys, color=line.get_color(), marker=".", label=label)
    ev.set_title(f"eval reward ({EVAL_KEY})")
    tr.set_title(f"train reward ({TRAIN_KEY}; {SMOOTH_WINDOW}-step mean over faint per-step values)")
    tr.set_xlabel("step")
    for ax in (ev, tr):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def report(runs: dict[str, list[dict]]) -> list[str]:
    """One line per run with its last eval reward, then the range over the runs that evaluated."""
    width = max(len(label) for label in runs)
    lines, finals = [], []
    for label, rows in runs.items():
        last = last_eval(rows)
        if last is None:
            lines.append(f"{label:<{width}}  no eval reward logged")
            continue
        finals.append(last[1])
        lines.append(f"{label:<{width}}  eval reward {last[1]:.4f} at step {last[0]}")
    if finals:
        lines.append(f"{'range':<{width}}  {min(finals):.4f} - {max(finals):.4f} over {len(finals)} run(s)")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, default=Path("reward_curves.png"))
    ap.add_argument("--labels", default=None, help="comma list, one per run directory (default: their names)")
    a = ap.parse_args(argv)
    labels = a.labels.split(",") if a.labels else [d.name for d in a.run_dirs]
    if len(labels) != len(a.run_dirs):
        ap.error(f"--labels gives {len(labels)} labels for {len(a.run_dirs)} run directories")
    if len(set(labels)) != len(labels):
        ap.error(f"the runs' labels {labels} repeat; name them with --labels")
    runs = {}
    for label, run_dir in zip(labels, a.run_dirs):
        try:
            runs[label] = read_metrics(run_dir / "metrics.jsonl")
        except FileNotFoundError as err:
            print(f"plot_reward_curves: {err}", file=sys.stderr)
            return 2
    plot_runs(runs, a.out)
    print("\n".join(report(runs)))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
