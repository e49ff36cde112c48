# deep_ep developer entry points. `make help` lists them.
#
# Everything runs in a virtual environment under .venv, created on first use:
#   1. torch==2.13.0 first (on the project machines pip takes a local CPU build; an unpinned torch would
#      download a multi-GB CUDA build), then
#   2. this project in editable mode with its test and sim extras, DEEP_EP_CPU_ONLY=1 (no CUDA build).
# A GPU machine that already has a CUDA torch should follow docs/build.md instead.

PYTHON        ?= python3
VENV          ?= .venv
TORCH_VERSION ?= 2.13.0
PY            := $(VENV)/bin/python
STAMP         := $(VENV)/.deep_ep-installed
PYTEST_ARGS   ?=
NVCC          ?= nvcc
NVCC_ARCH     ?= sm_90a
SIM_ARGS      ?= --nodes 8 --compare deepep
DEMO_ARGS     ?=

.PHONY: help setup test test-fast run sim demo compile-check lint clean

help:
	@echo "make setup          create $(VENV) and install torch==$(TORCH_VERSION) + deep_ep[test,sim] (CPU only)"
	@echo "make test           run the whole test suite (HYPOTHESIS_PROFILE=ci; GPU tests skip without CUDA)"
	@echo "make test-fast      run the suite with the quick 'dev' hypothesis profile"
	@echo "make run            simulator capacity plan (deep_ep vs DeepEP V1 kernels, 8 nodes) + 4-process CPU demo"
	@echo "make sim            simulator capacity plan only (SIM_ARGS, default: $(SIM_ARGS))"
	@echo "make demo           4-process CPU dispatch -> expert -> combine demo only (DEMO_ARGS)"
	@echo "make compile-check  compile csrc/ for $(NVCC_ARCH) with nvcc, without linking"
	@echo "make lint           ruff check (if ruff is installed in $(VENV))"
	@echo "make clean          remove $(VENV) and build outputs"
	@echo "make help           this list"

setup: $(STAMP)

$(STAMP): setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	DEEP_EP_CPU_ONLY=1 $(PY) -m pip install --quiet -e ".[test,sim]"
	$(PY) -c "import torch, deep_ep; print('setup ok: torch', torch.__version__)"
	touch $(STAMP)

test: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest --durations=15 $(PYTEST_ARGS)

test-fast: $(STAMP)
	HYPOTHESIS_PROFILE=dev $(PY) -m pytest -q $(PYTEST_ARGS)

sim: $(STAMP)
	$(PY) -m simulator $(SIM_ARGS)

demo: $(STAMP)
	$(PY) examples/cpu_demo.py $(DEMO_ARGS)

run: $(STAMP)
	@echo "== (a) capacity plan for deep_ep's kernels beside DeepEP V1's: python -m simulator $(SIM_ARGS)"
	$(PY) -m simulator $(SIM_ARGS)
	@echo "== (b) 4-process CPU dispatch -> expert -> combine demo"
	$(PY) examples/cpu_demo.py $(DEMO_ARGS)

# Compiles every CUDA source for $(NVCC_ARCH) without linking; needs nvcc, no GPU. tools/compile_check.sh is the
# authority when present (kernels with nvcc, host files against torch's headers, using the venv's torch). Without
# it, each torch-free kernel file csrc/kernels/*.cu is compiled alone with nvcc -c; files that need NVSHMEM are
# compiled only when NVSHMEM_DIR is set.
COMPILE_CHECK_SCRIPT := tools/compile_check.sh

compile-check: $(STAMP)
	@if [ -f $(COMPILE_CHECK_SCRIPT) ]; then \
		echo "compile-check: $(COMPILE_CHECK_SCRIPT)"; \
		NVCC="$$(command -v $(NVCC) || true)" PYTHON="$(abspath $(PY))" bash $(COMPILE_CHECK_SCRIPT); \
	elif ! ls csrc/kernels/*.cu >/dev/null 2>&1; then \
		echo "compile-check: csrc/kernels has no .cu files yet; nothing to compile"; \
	elif ! command -v $(NVCC) >/dev/null 2>&1; then \
		echo "compile-check: $(NVCC) not found; skipped"; \
	else \
		set -e; out=$$(mktemp -d); \
		for f in csrc/kernels/*.cu; do \
			case "$$(basename $$f)" in \
				low_latency*.cu|*_nvshmem.cu|internode*.cu) \
					if [ -z "$${NVSHMEM_DIR:-}" ]; then echo "compile-check: $$f needs NVSHMEM (set NVSHMEM_DIR); skipped"; continue; fi; \
					extra="-rdc=true -I$${NVSHMEM_DIR}/include";; \
				*) extra="-DDEEP_EP_DISABLE_NVSHMEM";; \
			esac; \
			echo "compile-check: $(NVCC) -c -arch=$(NVCC_ARCH) $$f"; \
			$(NVCC) -c -std=c++17 -O3 -arch=$(NVCC_ARCH) --expt-relaxed-constexpr -Icsrc -Icsrc/kernels \
				-I$$(dirname $$(dirname $$(command -v $(NVCC))))/include/cccl $$extra $$f -o $$out/$$(basename $$f).o; \
		done; rm -rf $$out; echo "compile-check: ok"; \
	fi

lint: $(STAMP)
	@if $(PY) -m ruff --version >/dev/null 2>&1; then $(PY) -m ruff check .; \
	else echo "lint: ruff is not installed in $(VENV) ($(PY) -m pip install ruff)"; fi

clean:
	rm -rf $(VENV) build dist *.egg-info deep_ep/_C*.so .pytest_cache .hypothesis
