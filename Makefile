# Two commands set everything up: `make demo` and `make test`. Both are idempotent.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pushkv-installed
# NIXL over UCX on loopback only: no traffic leaves the machine.
export UCX_TLS ?= tcp,sm,self
export UCX_NET_DEVICES ?= lo
export HF_HUB_OFFLINE := 1
# Bytecode is cached even where the environment sets PYTHONDONTWRITEBYTECODE=1 (as CI's does):
# the 0.26 venv is installed --no-compile, and without a cache every process, each vLLM
# server's three among them, recompiled every module it imported.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv test unit perf lint demo clean bench-smoke test-vllm026 soak

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)
	touch $@

venv: $(STAMP)

# Precise CPU and time budgets are `perf` tests: CI runs them with generous bounds only.
# Pure unit tests first: `.ci/run` installs the vLLM 0.26 venv beside them (tests that start
# servers come after, on a quieter machine).
# The slowest 40 are listed at the end: where CI's time goes, on whichever machine ran it.
test: $(STAMP)
	$(PY) -m pytest -q -m "not perf" --durations=40 tests/unit tests/docs tests/integration tests/browser tests/e2e

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

perf: $(STAMP)
	$(PY) -m pytest -q -rA -m perf

# The same checks run per commit after `pre-commit install` (.pre-commit-config.yaml: local hooks
# that call this venv's ruff and mypy, nothing fetched).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The 1 x 2 sweep of `pushkv bench --sweep --smoke` with its checks (part of `make test` too).
bench-smoke: $(STAMP)
	$(PY) -m pytest -q -s tests/e2e/test_sweep_smoke.py

# The soak's long form: 2,000 requests, 16 at a time, 10 % client aborts, P killed -9 and
# restarted midway (`make test` runs a 240-request form: tests/e2e/test_soak_e2e.py).
# Exit 1 on a broken promise; the report is $(SOAK_DIR)/soak.json.
SOAK_DIR ?= runs/soak-$(shell date +%Y%m%d-%H%M%S)
soak: $(STAMP)
	$(PY) -m bench.soak --requests 2000 --run-dir $(SOAK_DIR)

# vLLM 0.26 in a second venv (scripts/install.sh .venv026 0.26.0): the version adapter's
# unit tests against the real 0.26, and greedy P/D through the router equal to one instance.
VENV026 := .venv026
$(VENV026)/.pushkv-installed: pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV026) 0.26.0
	touch $@

test-vllm026: $(VENV026)/.pushkv-installed
	$(VENV026)/bin/python -m pytest -q -p no:cacheprovider tests/unit/test_vllm_compat.py \
	  tests/e2e/test_push_e2e.py::test_greedy_equals_single_instance

demo: $(STAMP)
	$(VENV)/bin/pushkv demo

clean:
	rm -rf $(VENV) $(VENV026) .pytest_cache .hypothesis .mypy_cache .ruff_cache
