# Two commands on a fresh machine:
#   make demo   - the main job: a simulated 2-node x 2-rank cluster on this host
#   make test   - the test suite
# Both create .venv and install torch 2.13.0 (CPU build where that is what pip finds) and this package.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench gpu-check compile-matrix clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash examples/demo.sh

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15 tests

# Every strategy, bf16 and the optimizer across replicas compiled against eager (tests/test_compile.py's
# matrix; `make test` runs its named subset only, to keep inductor's compile time out of the suite)
compile-matrix: $(STAMP)
	HYBRIDSHARD_COMPILE_MATRIX=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/test_compile.py

# hybridshard vs FSDP1/FSDP2/no-communication floor on 2 simulated nodes x 2 ranks (loopback);
# e.g. make bench BENCH_ARGS="--strategy hybrid_shard_zero2 --inter-node-bandwidth 1gbit" (shaping needs root)
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/python benchmarks/plan_scale.py
	OMP_NUM_THREADS=1 $(BIN)/hybridshard bench --out bench-results $(BENCH_ARGS)

# The CUDA checks, in one command on a machine with a GPU: benchmarks/gpu_check.py's steps in priority
# order, each under its own time budget (11 min 30 s in all); GPU_CHECK_STEPS=1,3 runs a subset. Without
# a GPU every step says it skipped and the target succeeds. The NVML answers are recorded even when
# a step failed (the target then fails after recording them). Where $(PYTHON) already has a CUDA build of torch (a GPU node's
# own environment, often without a package index), that torch is used and this package is installed
# beside it into $(GPU_SITE) (no index needed, nothing changed in that environment); otherwise the
# checks run in .venv (`make install`). The NVML answers go to $(NVML_OUT).
GPU_CHECK_STEPS ?=
GPU_SITE ?= build/gpu-check-site
NVML_OUT ?= tests/fixtures/nvml/gpu-check-$(shell hostname -s 2>/dev/null || echo host).json
gpu-check:
	@set -e; \
	if $(PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
	  PY=$(PYTHON); rm -rf $(GPU_SITE); \
	  $$PY -m pip install -q --no-deps --no-build-isolation --target $(GPU_SITE) . ; \
	  export PYTHONPATH=$(CURDIR)/$(GPU_SITE); \
	else \
	  $(MAKE) --no-print-directory install; PY=$(BIN)/python; \
	fi; \
	$$PY -c "import torch; print('gpu-check: torch', torch.__version__, '| CUDA device:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"; \
	rc=0; OMP_NUM_THREADS=1 GPU_CHECK_STEPS="$(GPU_CHECK_STEPS)" $$PY benchmarks/gpu_check.py || rc=$$?; \
	if $$PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
	  (cd / && $$PY -m hybridshard.topology.nvml record -o $(abspath $(NVML_OUT)) --description "recorded by make gpu-check") \
	    && echo "gpu-check: NVML answers in $(NVML_OUT)"; \
	else echo "gpu-check: NVML recording skipped: no CUDA device on this machine"; fi; \
	exit $$rc

clean:
	rm -rf $(VENV) build *.egg-info
