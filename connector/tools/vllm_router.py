"""vLLM's Rust router (``vllm-router``, PyPI) as a child process, in its NIXL P/D mode in front
of one P and one D: what ``pushkv bench``'s ``*-vr`` configurations and
``tests/e2e/test_vllm_router_e2e.py`` put where ``pushkv router`` would be (docs/routers.md).

Owns: ``VllmRouterProcess`` (its command line, start, ``/health``, stop by process group, as
``connector.tools.stack.ChildProcess``) and ``require_vllm_router`` (a clear error where it is
not installed). Must not import vLLM, NIXL or torch; ``vllm_router`` is only looked up, never
imported (the router runs as ``python -m vllm_router.launch_router``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, ClassVar

from connector.tools.stack import ChildProcess, ServerError

VLLM_ROUTER_MODULE = "vllm_router"
INSTALL_HINT = (
    "pip install 'vllm-router==0.1.17' (it is in pushkv's test extra: pip install -e '.[test]')"
)
# Seconds between its checks that P and D are up when it starts (its default 30 s would add
# up to that much to a stack started all at once).
STARTUP_CHECK_INTERVAL_S = 1


def vllm_router_installed() -> bool:
    return importlib.util.find_spec(VLLM_ROUTER_MODULE) is not None


def require_vllm_router(what: str) -> None:
    """``ServerError`` naming ``what`` needs it, where ``vllm-router`` is not installed."""
    if not vllm_router_installed():
        raise ServerError(f"{what} needs vllm-router, which is not installed: {INSTALL_HINT}")


@dataclass
class VllmRouterProcess(ChildProcess):
    """``vllm-router`` in vLLM's NIXL P/D mode in front of one P and one D; healthy when its
    ``/health`` answers 200. Its Prometheus metrics listen on ``prometheus_port``."""

    kind: ClassVar[str] = "vllm-router"
    prefill_url: str
    decode_url: str
    port: int
    prometheus_port: int
    log_path: Path | None = None
    host: str = "127.0.0.1"
    request_timeout_s: int = 1800  # its own default; a leg that takes longer is cut
    python: str = sys.executable
    env: Mapping[str, str] = field(default_factory=dict)  # added to this environment
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _log_file: IO[bytes] | None = field(default=None, init=False, repr=False)

    def command(self) -> list[str]:
        return [
            self.python,
            "-m",
            f"{VLLM_ROUTER_MODULE}.launch_router",
            "--vllm-pd-disaggregation",
            "--kv-connector",
            "nixl",
            "--prefill",
            self.prefill_url,
            "--decode",
            self.decode_url,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--prometheus-host",
            self.host,
            "--prometheus-port",
            str(self.prometheus_port),
            "--request-timeout-secs",
            str(self.request_timeout_s),
            "--worker-startup-check-interval",
            str(STARTUP_CHECK_INTERVAL_S),
        ]

    def start(self) -> None:
        require_vllm_router(f"{self.kind} on port {self.port}")
        self._spawn({**os.environ, **self.env})

    def stop(self, timeout_s: float = 10.0) -> None:
        super().stop(timeout_s)
