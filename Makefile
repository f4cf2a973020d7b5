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

bench: $(STAMP)
	$(BIN)/python benchmarks/plan_scale.py

clean:
	rm -rf $(VENV) build *.egg-info
