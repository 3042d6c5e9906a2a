#!/usr/bin/env bash
# Qwen3.5-35B-A3B DAPO with MTP speculative decoding (k = 2) on 2 nodes of 8 x 141 GB GPUs (see
# recipes/qwen3_5_35b_a3b_dapo.yaml for the hardware, layout and what the training side must support),
# submitted as a Ray job:
#   RAY_API_SERVER_ADDRESS=http://HEAD:8265 MODEL_PATH=/shared/Qwen3.5-35B-A3B \
#   TRAIN_FILES=/shared/data/dapo-math-17k.parquet RUN_DIR=/shared/runs/qwen3_5_35b_a3b_dapo \
#   scripts/launch_qwen3_5_35b_a3b_dapo.sh [key=value ...]
# Paths are as the cluster sees them (SUBMIT_ARGS=--skip-path-checks if they do not exist here).
exec "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/launch_dapo_recipe.sh" qwen3_5_35b_a3b_dapo "Qwen3.5-35B-A3B" "$@"
