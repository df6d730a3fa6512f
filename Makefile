# Entry points (train and test bootstrap their own virtual environment):
#   make train   -> the GMPO training demo on its built-in task (CPU by default)
#   make test    -> lint (ruff check, ruff format --check) and the test suite (what .ci/run calls)
#   make bench   -> on a CUDA machine: the README's main benchmark table (benchmarks/gpu_suite.sh, the
#                   machine's python3, no venv); elsewhere: a ~30 s CPU smoke run of the drivers.
#                   ARGS="..." runs `python -m benchmarks.run $(ARGS)` instead (benchmarks/README.md)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# pytest-xdist processes: one per core (an idle worker steals queued tests); TEST_WORKERS=0: one process
TEST_WORKERS ?= auto

.PHONY: train test venv bench clean

# uv installs the same packages as pip in seconds instead of minutes (resolution and downloads in parallel)
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv
	$(BIN)/uv pip install -q --python $(BIN)/python -e ".[test,tunix]"
	touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(BIN)/gmpo-jax train $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal --durations=25 $(PYTEST_ARGS)

bench:
ifneq ($(strip $(ARGS)),)
	$(MAKE) venv
	$(BIN)/python -m benchmarks.run $(ARGS)
else
	@if nvidia-smi -L >/dev/null 2>&1; then \
	  bash benchmarks/gpu_suite.sh; \
	else \
	  $(MAKE) -s venv && JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.run --suite cpu \
	    --results /tmp/gmpo_bench_cpu.jsonl --iters 3 --warmup 1 --min-time-s 0; \
	fi
endif

clean:
	rm -rf $(VENV) runs
