#!/usr/bin/env bash
# Qwen3.5-27B DAPO with MTP speculative decoding (k = 3) on 2 nodes of 8 x 80 GB GPUs (see
# recipes/qwen3_5_27b_dapo.yaml for the hardware and layout), submitted as a Ray job:
#   RAY_API_SERVER_ADDRESS=http://HEAD:8265 MODEL_PATH=/shared/Qwen3.5-27B \
#   TRAIN_FILES=/shared/data/dapo-math-17k.parquet RUN_DIR=/shared/runs/qwen3_5_27b_dapo \
#   scripts/launch_qwen3_5_27b_dapo.sh [key=value ...]
# Paths are as the cluster nodes see them. If they do not exist on this machine, set
# SUBMIT_ARGS=--skip-path-checks. TRAIN_FILES may list several files, comma-separated.
set -euo pipefail
: "${RAY_API_SERVER_ADDRESS:?set RAY_API_SERVER_ADDRESS to the Ray dashboard URL, e.g. http://head:8265}"
: "${MODEL_PATH:?set MODEL_PATH to the Qwen3.5-27B HF checkpoint directory}"
: "${TRAIN_FILES:?set TRAIN_FILES to the DAPO-Math prompt file(s) (parquet or JSONL), comma-separated}"
: "${RUN_DIR:?set RUN_DIR to a directory on shared storage (metrics, checkpoints, plots)}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ENV_ARGS=()
WANDB_ARGS=()   # wandb syncs when a key is given: logger.wandb_mode is the setting (WANDB_MODE is not read)
if [ -n "${WANDB_API_KEY:-}" ]; then ENV_ARGS+=(--env WANDB_API_KEY); WANDB_ARGS+=(logger.wandb_mode=online); fi
# shellcheck disable=SC2086  # SUBMIT_ARGS is a list of options
exec "$HERE/submit.sh" --address "$RAY_API_SERVER_ADDRESS" ${SUBMIT_ARGS:-} "${ENV_ARGS[@]}" -- \
  recipe=qwen3_5_27b_dapo "model.path=$MODEL_PATH" "data.train_files=[$TRAIN_FILES]" "trainer.run_dir=$RUN_DIR" "${WANDB_ARGS[@]}" "$@"
