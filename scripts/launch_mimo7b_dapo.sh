#!/usr/bin/env bash
# MiMo-7B-RL DAPO with MTP speculative decoding (k = 3) on one node of 8 x 80 GB GPUs (see
# recipes/mimo7b_dapo.yaml for the hardware and layout), submitted as a Ray job:
#   RAY_API_SERVER_ADDRESS=http://HEAD:8265 MODEL_PATH=/shared/MiMo-7B-RL \
#   TRAIN_FILES=/shared/data/dapo-math-17k.parquet RUN_DIR=/shared/runs/mimo7b_dapo \
#   scripts/launch_mimo7b_dapo.sh [key=value ...]
# Paths are as the cluster nodes see them. If they do not exist on this machine, set
# SUBMIT_ARGS=--skip-path-checks. TRAIN_FILES may list several files, comma-separated.
exec "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/launch_dapo_recipe.sh" mimo7b_dapo "MiMo-7B-RL" "$@"
