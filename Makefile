# Two entry points on a fresh machine: `make demo` and `make test` (each does all the set-up).
SHELL       := /bin/bash
.SHELLFLAGS := -o pipefail -c
VENV        ?= .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip
TORCH_SPEC  ?= torch==2.14.1
HF_SPEC     ?= transformers==4.57.*
ACCEL_SPEC  ?= accelerate==1.15.*
export CUDA_HOME ?= /usr/local/cuda
export MAX_JOBS ?= 2
# Test processes (pytest-xdist): one per core.
TEST_JOBS   ?= $(shell nproc 2>/dev/null || echo 2)
export PAGED_OPS_BUILD_CUDA ?= auto
# The CPU kernel builds this CPU runs (plus the portable one); CI builds them all.
export PAGED_OPS_CPU_VARIANTS ?= native
# Without a visible GPU build for Hopper only (CI proves the CUDA code compiles and links);
# with one, setup.py/torch build for the local GPU.
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAVE_GPU),)
export TORCH_CUDA_ARCH_LIST ?= 9.0
endif

.PHONY: venv install demo test bench lint clean

$(VENV)/.deps: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel ninja
	$(PIP) install -q "$(TORCH_SPEC)" numpy pytest pytest-xdist hypothesis expecttest "$(HF_SPEC)" "$(ACCEL_SPEC)" matplotlib
	touch $@

venv: $(VENV)/.deps

# Rebuild the extension only when its sources or build files change (setup.py, the CPU builds'
# flags in paged_ops/_cpu_build.py; the package itself is installed editable, so other Python
# edits need nothing); `make clean` forces a rebuild.
BUILD_INPUTS := setup.py pyproject.toml paged_ops/_cpu_build.py $(shell find csrc -type f)
# The build's output goes to build/install.log; the terminal gets a line per compiled unit.
$(VENV)/.built: $(VENV)/.deps $(BUILD_INPUTS)
	@mkdir -p build
	@echo "building paged_ops (CUDA: $(PAGED_OPS_BUILD_CUDA), CPU builds: $(PAGED_OPS_CPU_VARIANTS)); log: build/install.log"
	@$(PIP) install -v --no-build-isolation --no-deps -e . 2>&1 | tee build/install.log \
	  | sed -nEu 's/^ *(\[[0-9]+\/[0-9]+\]) .* -c [^ ]*\/(csrc\/[^ ]+) .*/  \1 \2/p; s/^ *(paged_ops: .*)/\1/p; /error:/p' \
	  || { echo "build failed; the end of build/install.log:"; tail -40 build/install.log; exit 1; }
	touch $@

install: $(VENV)/.built
	$(PY) -c "import paged_ops, torch; print('paged_ops built; CUDA kernels:', paged_ops.built_with_cuda(), '; CPU kernel:', paged_ops.cpu_kernel_variant(), '; torch', torch.__version__)"

demo: install
	$(PY) -m paged_ops.demo

test: install
	$(PY) .ci/check_build.py
	@$(PY) -c "import xdist" 2>/dev/null || $(PIP) install -q pytest-xdist  # older venvs
	$(PY) -m pytest -q -n $(TEST_JOBS) tests

bench: install
	$(PY) benchmarks/bench_attention.py

lint: venv
	$(PIP) install -q ruff
	$(VENV)/bin/ruff check paged_ops tests benchmarks

clean:
	rm -rf build *.egg-info paged_ops/*.so $(VENV)/.built
