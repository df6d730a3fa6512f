# Two entry points, each bootstrapping its own virtual environment:
#   make train   -> the GMPO training demo on its built-in task (CPU by default)
#   make test    -> the test suite (what .ci/run calls)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: train test venv bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,tunix]"
	touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(BIN)/gmpo-jax train $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(ARGS)

clean:
	rm -rf $(VENV) runs
