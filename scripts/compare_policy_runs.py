"""Are two runs' policies bitwise identical? Compare their metrics and final trunk weights.

For the isolation check of the decoupled draft loss: run the same recipe with
`trainer.mtp.loss_weight=1.0` and `=0.0` (speculative decoding on in both), then

    python scripts/compare_policy_runs.py RUN_DIR_A RUN_DIR_B

With `--draft-metrics` the head's metrics (draft loss, acceptance) must agree too: the same recipe and seed
run on two builds of the code, e.g. before and after a refactor.

Exit status 0 when identical (prints IDENTICAL), 1 otherwise (the differences are listed). The
comparison itself is skyrl_mtp.tracking.compare.compare_policy_runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from skyrl_mtp.tracking.compare import compare_policy_runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--draft-metrics", action="store_true", help="compare the MTP head's metrics too")
    args = ap.parse_args(argv)
    problems, summary = compare_policy_runs(args.run_a, args.run_b, draft_metrics=args.draft_metrics)
    print(json.dumps(summary))
    for p in problems[:50]:
        print("DIFF", p)
    print("IDENTICAL" if not problems else f"DIFFERENT ({len(problems)} differences)")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
