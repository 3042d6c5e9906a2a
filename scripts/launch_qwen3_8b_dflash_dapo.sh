#!/usr/bin/env bash
# Qwen3-8B DAPO with a DFlash drafter trained online (block 8, k = 7) on one node of 8 x 80 GB GPUs (see
# recipes/qwen3_8b_dflash_dapo.yaml for the hardware and layout), submitted as a Ray job:
#   RAY_API_SERVER_ADDRESS=http://HEAD:8265 MODEL_PATH=/shared/Qwen3-8B \
#   TRAIN_FILES=/shared/data/dapo-math-17k.parquet RUN_DIR=/shared/runs/qwen3_8b_dflash_dapo \
#   scripts/launch_qwen3_8b_dflash_dapo.sh [trainer.drafter.init=/shared/drafters/qwen3_8b_dflash] [key=value ...]
# Paths are as the cluster nodes see them. If they do not exist on this machine, set
# SUBMIT_ARGS=--skip-path-checks. TRAIN_FILES may list several files, comma-separated.
exec "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/launch_dapo_recipe.sh" qwen3_8b_dflash_dapo "Qwen3-8B" "$@"
