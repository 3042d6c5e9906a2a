#!/usr/bin/env bash
# The one prepared GPU check: on a machine with one CUDA GPU, Python 3.12 and torch but no network, install
# the wheels carried in .whl/ (megatron-core and the pure-Python packages the GPU tests import), then run the
# GPU-marked tests and benchmarks/train_step_gpu.py, all output into one folder. Meant to finish in under
# 8 minutes (each stage has its own time limit).
#
#   scripts/gpu_check.sh --download     # on a machine with network: fetch the wheels into .whl/ (git-ignored)
#   scripts/gpu_check.sh [OUT_DIR]      # on the GPU machine (default OUT_DIR: ./gpu_check_out, or $OUT)
#
# Without a GPU it says so and exits with status 3 after checking that its inputs are in place.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl
PY=${PYTHON:-python3}
# Pinned: megatron-core 0.19.2 is what the `gpu` extra resolves on Python 3.12. bm25s (pure Python, needs numpy):
# the tiny checkpoint's tokenizer is trained on text that includes BM25-retrieved documents (models/tiny.py).
# The GPU machine lacks ray, vllm, wandb, math-verify, datasets, fastapi and uvicorn too: nothing tests/gpu or the
# benchmark runs there needs them (tests/unit/test_gpu_check_script.py checks it with them made unimportable).
PACKAGES=(megatron-core==0.19.2 hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 bm25s==0.3.16)

if [[ "${1:-}" == "--download" ]]; then
  mkdir -p "$WHEELS"
  grep -qxF "/$WHEELS/" .git/info/exclude 2>/dev/null || echo "/$WHEELS/" >> .git/info/exclude
  platforms=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
  done
  for pkg in "${PACKAGES[@]}"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platforms[@]}" -d "$WHEELS" "$pkg" || \
    "$PY" -m pip wheel -q --no-deps -w "$WHEELS" "$pkg" || exit 1   # pure-Python sdists (antlr4 4.9.3)
  done
  du -sh "$WHEELS"
  exit 0
fi

OUT_DIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT_DIR"
log() { echo "[gpu_check] $*" | tee -a "$OUT_DIR/summary.txt"; }
log "start $(date -u +%FT%TZ) on $(hostname)"
missing=()
for pkg in "${PACKAGES[@]}"; do
  name=${pkg%%==*}; name=${name//-/_}
  compgen -G "$WHEELS/${name}-*.whl" > /dev/null || missing+=("$pkg")
done
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  log "no CUDA GPU found by $("$PY" -c 'import torch; print("torch", torch.__version__)' 2>&1): nothing to check here"
  [[ ${#missing[@]} -gt 0 ]] && log "wheels missing from $WHEELS/ (run scripts/gpu_check.sh --download): ${missing[*]}"
  exit 3
fi
if [[ ${#missing[@]} -gt 0 ]]; then
  log "wheels missing from $WHEELS/: ${missing[*]}; run scripts/gpu_check.sh --download where there is network"
  exit 2
fi
nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
  "$WHEELS"/*.whl > "$OUT_DIR/pip.log" 2>&1 || { log "wheel install failed (see pip.log)"; exit 2; }
export PYTHONPATH="$PWD:/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c "import torch, megatron.core; print('torch', torch.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0), '| megatron-core', megatron.core.__version__)" 2>&1 | tee -a "$OUT_DIR/summary.txt"

# 1. the GPU-marked tests (policy on CUDA, placement and weight sync where Ray / a 2nd GPU exist); each spawned policy
#    process takes ~25 s on an H200, the whole stage ~130 s
timeout 330 "$PY" -m pytest tests/gpu -m gpu -p no:cacheprovider -o addopts="" -rA --timeout=300 \
  --junitxml="$OUT_DIR/tests_gpu.xml" > "$OUT_DIR/tests_gpu.log" 2>&1
log "tests/gpu exit $? ($(grep -Eo '[0-9]+ (passed|failed|skipped|error)[a-z]*' "$OUT_DIR/tests_gpu.log" | tr '\n' ' '))"

# 2. the GPU train-step benchmark (tokens/s, MFU, peak memory, the draft loss's share)
timeout 120 "$PY" benchmarks/train_step_gpu.py --json "$OUT_DIR/train_step_gpu.json" > "$OUT_DIR/train_step_gpu.log" 2>&1
log "train_step_gpu exit $?"
log "end $(date -u +%FT%TZ)"
