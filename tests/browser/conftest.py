"""A real ``streamlit run`` of the dashboard on 127.0.0.1 and Debian's Chromium via Playwright.

The server is started once per module (``dashboard.launch.command``) and stopped by its PID;
every wait is bounded and fails with what was seen. No browser is downloaded: Playwright
drives ``/usr/bin/chromium`` (``scripts/install.sh`` installs it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from connector.transport.ports import free_port
from dashboard.launch import command
from tests.fixtures.traces import HERE

CHROMIUM = Path("/usr/bin/chromium")
# What ``streamlit run`` serves when a link names no run: traces recorded from real vLLM
# (router, P and D), so a bare ``/?trace=<id>`` opens a whole push request.
LAUNCH_RUN = HERE / "real-push"
START_TIMEOUT_S = 90  # a loaded 2-core box can take tens of seconds to import streamlit


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"streamlit exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.read().strip() == b"ok":
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)  # polling interval of a bounded wait, not synchronisation by sleep
    raise AssertionError(
        f"streamlit not healthy at {url} within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}"
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


@pytest.fixture(scope="module")
def dashboard_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} missing: run scripts/install.sh (apt-get install chromium)")
    port = free_port()
    log = tmp_path_factory.mktemp("streamlit") / "streamlit.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(command(LAUNCH_RUN, port), stdout=fh, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} missing: run scripts/install.sh (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            yield b
        finally:
            b.close()
