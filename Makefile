# Two commands on a fresh machine:
#   make demo   - the main job: a simulated 2-node x 2-rank cluster on this host
#   make test   - the test suite
# Both create .venv and install torch 2.13.0 (CPU build where that is what pip finds) and this package.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench clean

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

clean:
	rm -rf $(VENV) build *.egg-info
