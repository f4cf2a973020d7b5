# Two commands on a fresh machine:
#   make demo   - the main job: a simulated 2-node x 2-rank cluster on this host
#   make test   - the test suite
# Both create .venv and install torch 2.13.0 (CPU build where that is what pip finds) and this package.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash examples/demo.sh

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests

# hybridshard vs FSDP1/FSDP2/no-communication floor on 2 simulated nodes x 2 ranks (loopback);
# e.g. make bench BENCH_ARGS="--strategy hybrid_shard_zero2 --inter-node-bandwidth 1gbit" (shaping needs root)
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/python benchmarks/plan_scale.py
	OMP_NUM_THREADS=1 $(BIN)/hybridshard bench --out bench-results $(BENCH_ARGS)

# The CUDA checks, in one command on a machine with a GPU (a few minutes); without one every step says
# it skipped and the target succeeds. If `make install` cannot install (no registry), it goes on with
# $(PYTHON) and the torch installed there (a venv over its site-packages, this package added).
# The NVML answers go to tests/fixtures/nvml/$(NVML_NAME).json.
GPU_VENV ?= .venv-system
NVML_NAME ?= gpu-check-$(shell hostname -s 2>/dev/null || echo host)
gpu-check:
	@$(MAKE) --no-print-directory install || { \
	  echo "gpu-check: make install failed; using $(PYTHON)'s own torch in $(GPU_VENV)"; \
	  $(PYTHON) -m venv --system-site-packages $(GPU_VENV) && \
	  $(GPU_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e . ; }
	@PY=$(BIN)/python; [ -f $(STAMP) ] || PY=$(GPU_VENV)/bin/python; \
	set -e; \
	$$PY -c "import torch; print('gpu-check: torch', torch.__version__, '| CUDA device:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"; \
	OMP_NUM_THREADS=1 PYTHONPATH=$(CURDIR) $$PY -m pytest -q -s -rs tests/test_cuda.py; \
	PYTHONPATH=$(CURDIR) $$PY benchmarks/gpu_step.py; \
	PYTHONPATH=$(CURDIR) $$PY benchmarks/gpu_step.py --dtype bf16; \
	if $$PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
	  PYTHONPATH=$(CURDIR) $$PY -m hybridshard.topology.nvml record -o tests/fixtures/nvml/$(NVML_NAME).json \
	    --description "recorded by make gpu-check" && echo "gpu-check: NVML answers in tests/fixtures/nvml/$(NVML_NAME).json"; \
	else echo "gpu-check: NVML recording skipped: no CUDA device on this machine"; fi

clean:
	rm -rf $(VENV) $(GPU_VENV) build *.egg-info
