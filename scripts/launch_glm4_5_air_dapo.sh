#!/usr/bin/env bash
# GLM-4.5-Air DAPO with MTP speculative decoding (k = 2) on 4 nodes of 8 x 141 GB GPUs (see
# recipes/glm4_5_air_dapo.yaml for the hardware, layout and what the training side must support),
# submitted as a Ray job:
#   RAY_API_SERVER_ADDRESS=http://HEAD:8265 MODEL_PATH=/shared/GLM-4.5-Air \
#   TRAIN_FILES=/shared/data/dapo-math-17k.parquet RUN_DIR=/shared/runs/glm4_5_air_dapo \
#   scripts/launch_glm4_5_air_dapo.sh [key=value ...]
# Paths are as the cluster sees them (SUBMIT_ARGS=--skip-path-checks if they do not exist here).
set -euo pipefail
: "${RAY_API_SERVER_ADDRESS:?set RAY_API_SERVER_ADDRESS to the Ray dashboard URL, e.g. http://head:8265}"
: "${MODEL_PATH:?set MODEL_PATH to the GLM-4.5-Air HF checkpoint directory}"
: "${TRAIN_FILES:?set TRAIN_FILES to the DAPO-Math prompt file(s) (parquet or JSONL), comma-separated}"
: "${RUN_DIR:?set RUN_DIR to a directory on shared storage (metrics, checkpoints, plots)}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ENV_ARGS=()
WANDB_ARGS=()   # wandb syncs when a key is given: logger.wandb_mode is the setting (WANDB_MODE is not read)
if [ -n "${WANDB_API_KEY:-}" ]; then ENV_ARGS+=(--env WANDB_API_KEY); WANDB_ARGS+=(logger.wandb_mode=online); fi
# shellcheck disable=SC2086  # SUBMIT_ARGS is a list of options
exec "$HERE/submit.sh" --address "$RAY_API_SERVER_ADDRESS" ${SUBMIT_ARGS:-} "${ENV_ARGS[@]}" -- \
  recipe=glm4_5_air_dapo "model.path=$MODEL_PATH" "data.train_files=[$TRAIN_FILES]" "trainer.run_dir=$RUN_DIR" "${WANDB_ARGS[@]}" "$@"
