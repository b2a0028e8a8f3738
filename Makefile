# Two commands set everything up: `make demo` and `make test`. Both are idempotent.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pushkv-installed
# NIXL over UCX on loopback only: no traffic leaves the machine.
export UCX_TLS ?= tcp,sm,self
export UCX_NET_DEVICES ?= lo
export HF_HUB_OFFLINE := 1

.PHONY: venv test unit demo clean

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)
	touch $@

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

demo: $(STAMP)
	$(VENV)/bin/pushkv demo

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
