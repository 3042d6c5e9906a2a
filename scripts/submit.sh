#!/usr/bin/env bash
# Run a recipe on a Ray cluster as a Ray job, streaming its logs; exits with the job's status.
#   scripts/submit.sh --address http://HEAD:8265 [--env K=V ...] [--no-wait] -- recipe=NAME key=value ...
# A thin wrapper over `python -m skyrl_mtp.cluster.submit` (all options: scripts/submit.sh --help) that
# uploads this repository as the job's working dir. The config is validated here before submitting.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
if [ ! -x "$PYTHON" ]; then PYTHON="$(command -v python3)"; fi
cd "$REPO"
exec "$PYTHON" -m skyrl_mtp.cluster.submit --working-dir "$REPO" "$@"
