#!/usr/bin/env bash
# GLM-4.5-Air DAPO with MTP speculative decoding (k = 2) on 4 nodes of 8 x 141 GB GPUs (see
# recipes/glm4_5_air_dapo.yaml for the hardware, layout and what the training side must support),
# submitted as a Ray job:
#   RAY_API_SERVER_ADDRESS=http://HEAD:8265 MODEL_PATH=/shared/GLM-4.5-Air \
#   TRAIN_FILES=/shared/data/dapo-math-17k.parquet RUN_DIR=/shared/runs/glm4_5_air_dapo \
#   scripts/launch_glm4_5_air_dapo.sh [key=value ...]
# Paths are as the cluster sees them (SUBMIT_ARGS=--skip-path-checks if they do not exist here).
exec "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/launch_dapo_recipe.sh" glm4_5_air_dapo "GLM-4.5-Air" "$@"
