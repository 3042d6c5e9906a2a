#!/usr/bin/env bash
# MiMo-7B SearchR1 (multi-turn search, MTP k = 3 in every turn) on one node of 8 x 80 GB GPUs (see
# recipes/mimo7b_searchr1.yaml), submitted as a Ray job:
#   RAY_API_SERVER_ADDRESS=http://HEAD:8265 MODEL_PATH=/shared/MiMo-7B-RL \
#   TRAIN_FILES=/shared/data/searchr1_train.parquet RUN_DIR=/shared/runs/mimo7b_searchr1 \
#   RETRIEVER_URL=http://retriever-host:8000 scripts/launch_mimo7b_searchr1.sh [key=value ...]
# Instead of RETRIEVER_URL (a Search-R1 /retrieve server, e.g. e5 + FAISS), CORPUS_FILE=/shared/corpus.jsonl
# serves BM25 over a JSONL corpus from inside the run. Prepare TRAIN_FILES with
# scripts/prepare_searchr1_data.py. Paths are as the cluster sees them (SUBMIT_ARGS=--skip-path-checks
# if they do not exist here).
set -euo pipefail
: "${RAY_API_SERVER_ADDRESS:?set RAY_API_SERVER_ADDRESS to the Ray dashboard URL, e.g. http://head:8265}"
: "${MODEL_PATH:?set MODEL_PATH to the MiMo-7B-RL HF checkpoint directory}"
: "${TRAIN_FILES:?set TRAIN_FILES to the prepared Search-R1 training file(s), comma-separated}"
: "${RUN_DIR:?set RUN_DIR to a directory on shared storage (metrics, checkpoints, plots)}"
if [ -n "${RETRIEVER_URL:-}" ]; then
  RETRIEVER=("environment.search.retriever_url=$RETRIEVER_URL")
elif [ -n "${CORPUS_FILE:-}" ]; then
  RETRIEVER=("environment.search.corpus_file=$CORPUS_FILE")
else
  echo "set RETRIEVER_URL (a running /retrieve server) or CORPUS_FILE (a JSONL corpus served with BM25)" >&2
  exit 2
fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ENV_ARGS=()
WANDB_ARGS=()   # wandb syncs when a key is given: logger.wandb_mode is the setting (WANDB_MODE is not read)
if [ -n "${WANDB_API_KEY:-}" ]; then ENV_ARGS+=(--env WANDB_API_KEY); WANDB_ARGS+=(logger.wandb_mode=online); fi
# shellcheck disable=SC2086  # SUBMIT_ARGS is a list of options
exec "$HERE/submit.sh" --address "$RAY_API_SERVER_ADDRESS" ${SUBMIT_ARGS:-} "${ENV_ARGS[@]}" -- \
  recipe=mimo7b_searchr1 "model.path=$MODEL_PATH" "data.train_files=[$TRAIN_FILES]" "trainer.run_dir=$RUN_DIR" \
  "${RETRIEVER[@]}" "${WANDB_ARGS[@]}" "$@"
