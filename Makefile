# Two commands: `make serve` (install + start the server on the embedded tiny model, CPU)
# and `make test` (install + run the whole test suite). Each creates .venv itself.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Pin torch first so the range in pyproject.toml installs nothing more (for the CPU-only wheel:
# TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu").
# On Ascend, install torch-npu's own torch instead: `make TORCH_SPEC="torch-npu" LOCK= ...`.
TORCH_SPEC ?= torch==2.13.0
# Every other version comes from the lock (the versions the suite last passed with), so a release upstream
# cannot change what a user's first command installs. `make lock` refreshes it on purpose; `LOCK=` (empty)
# installs the newest versions pyproject.toml allows instead.
LOCK ?= requirements.lock
STAMP := $(VENV)/.installed

.PHONY: serve test test-fast test-latest lock lint bench

# --no-compile: pip would byte-compile all ~250 MB of installed Python, ~80 CPU s on one core (measured:
# installing transformers alone, 54 MB of .py, 19.7 -> 2.7 CPU s). The install byte-compiles what a
# server start imports instead (server/cli/bytecode.py, ~30 s on 2 cores): where PYTHONDONTWRITEBYTECODE
# is set (some environments set it) Python would otherwise compile it again in every process it starts
# (~12 s each: the server, its workers, the compile children).
$(STAMP): pyproject.toml setup.py $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile $(TORCH_SPEC)
	$(BIN)/pip install -q --no-compile $(if $(LOCK),-c $(LOCK)) -e '.[test]'
	# The C++ CPU kernels, built once here into the venv (~30 s on 2 cores) rather than by a server start.
	$(BIN)/python -m xinserve.kernels.cpu.cpp_build --install
	$(BIN)/python -m xinserve.server.cli.bytecode
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/xinserve serve

# Two xdist workers (one per core of the 2-core reference machine; `make test TEST_WORKERS=4` on more);
# files that share a server run on one worker, slow ones first (tests/xdist_groups.py). The 15 slowest
# tests are listed at the end. `make test-fast` leaves out the tests marked `slow`.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

test: $(STAMP)
	$(BIN)/ruff check .
	$(PYTEST)

test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(PYTEST) -m "not slow"

# The suite on the newest versions pyproject.toml allows (what `pip install xinserve` would pick today), in a
# venv of its own that is upgraded on every run.
test-latest:
	$(PYTHON) -m venv .venv-latest
	.venv-latest/bin/pip install -q --no-compile $(TORCH_SPEC)
	.venv-latest/bin/pip install -q --no-compile --upgrade --upgrade-strategy eager -e '.[test]'
	touch .venv-latest/.installed
	$(MAKE) test VENV=.venv-latest LOCK=

# Refresh the lock on purpose: the newest versions pyproject.toml allows, resolved for every Python the
# project supports (torch is left to TORCH_SPEC, vendors pin their own), then the suite against the result.
lock: $(STAMP)
	$(BIN)/pip install -q --no-compile 'uv>=0.9'
	$(BIN)/uv pip compile -q pyproject.toml --extra test --extra bench --universal --python-version 3.10 \
		--no-emit-package torch --custom-compile-command "make lock" -o $(LOCK)
	$(MAKE) test

bench: $(STAMP)
	$(BIN)/python benchmarks/offline_throughput.py
