#!/usr/bin/env bash
# Submits a DAPO recipe as a Ray job with the paths taken from the environment; called by the per-recipe
# scripts/launch_*_dapo.sh (each says its hardware):
#   scripts/launch_dapo_recipe.sh RECIPE "MODEL NAME" [key=value ...]
# Environment: RAY_API_SERVER_ADDRESS, MODEL_PATH, TRAIN_FILES (comma-separated), RUN_DIR; optional
# SUBMIT_ARGS (e.g. --skip-path-checks) and WANDB_API_KEY.
set -euo pipefail
recipe="${1:?usage: launch_dapo_recipe.sh RECIPE \"MODEL NAME\" [key=value ...]}"
model="${2:?usage: launch_dapo_recipe.sh RECIPE \"MODEL NAME\" [key=value ...]}"
shift 2
: "${RAY_API_SERVER_ADDRESS:?set RAY_API_SERVER_ADDRESS to the Ray dashboard URL, e.g. http://head:8265}"
: "${MODEL_PATH:?set MODEL_PATH to the $model HF checkpoint directory}"
: "${TRAIN_FILES:?set TRAIN_FILES to the DAPO-Math prompt file(s) (parquet or JSONL), comma-separated}"
: "${RUN_DIR:?set RUN_DIR to a directory on shared storage (metrics, checkpoints, plots)}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ENV_ARGS=()
WANDB_ARGS=()   # wandb syncs when a key is given: logger.wandb_mode is the setting (WANDB_MODE is not read)
if [ -n "${WANDB_API_KEY:-}" ]; then ENV_ARGS+=(--env WANDB_API_KEY); WANDB_ARGS+=(logger.wandb_mode=online); fi
# shellcheck disable=SC2086  # SUBMIT_ARGS is a list of options
exec "$HERE/submit.sh" --address "$RAY_API_SERVER_ADDRESS" ${SUBMIT_ARGS:-} "${ENV_ARGS[@]}" -- \
  "recipe=$recipe" "model.path=$MODEL_PATH" "data.train_files=[$TRAIN_FILES]" "trainer.run_dir=$RUN_DIR" "${WANDB_ARGS[@]}" "$@"
