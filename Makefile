# Two commands set everything up: `make demo` and `make test`. Both are idempotent.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pushkv-installed
# NIXL over UCX on loopback only: no traffic leaves the machine.
export UCX_TLS ?= tcp,sm,self
export UCX_NET_DEVICES ?= lo
export HF_HUB_OFFLINE := 1

.PHONY: venv test unit perf lint demo clean bench-smoke

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)
	touch $@

venv: $(STAMP)

# Precise CPU and time budgets are `perf` tests: CI runs them with generous bounds only.
test: $(STAMP)
	$(PY) -m pytest -q -m "not perf"

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

# The 2 x 2 sweep of `pushkv bench --sweep --smoke` with its checks (part of `make test` too).
bench-smoke: $(STAMP)
	$(PY) -m pytest -q -s tests/e2e/test_sweep_smoke.py

demo: $(STAMP)
	$(VENV)/bin/pushkv demo

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache
