# Entry points: `make demo` (the whole async RL loop on this machine), `make test`, and
# `make test-containers` (the CPU compose stack on a real Docker engine, tests/test_containers.py).
# Both create ./.venv on first use; torch is pinned first so pip takes the CPU wheel.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tandem-installed
TORCH  ?= torch==2.13.0
ARGS   ?=
# Test processes: most tests wait on services they start (imports, start-up), so two workers
# take ~18-20 min of a 2-core machine where one takes ~29.
TEST_WORKERS ?= 2

.PHONY: demo test test-containers lint install clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	# SGLang's own routes and request/response definitions, read (never imported) by
	# tests/sglang_surface.py (the stand-in worker tests/fake_sglang.py takes exactly what this
	# version takes) and tests/test_engine_sglang_shapes.py. Moving the pin: change the version
	# here and run tests/test_sglang_contract.py and tests/test_router_*.py.
	# --no-deps: it is only read, never run (its dependencies are a GPU serving stack).
	$(PY) -m pip install --quiet --no-deps "sglang==0.5.23"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tandem up $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The container test is not part of `make test`: it needs root (or a Docker engine) and ~10 min.
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) -ra --durations=30 -m "not containers" $(ARGS)

# Builds the images (cached in Docker after the first run) and runs the CPU stack with its faults;
# installs Debian's docker.io/docker-compose/debootstrap and starts dockerd when missing (root).
# Outside CI it skips on a machine where Docker cannot be set up; in CI (CI set) it fails.
test-containers: $(STAMP)
	$(PY) -m pytest -q -x -p no:randomly -ra -s -m containers tests/test_containers.py $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
