"""``pushkv collect`` as a child process for tests: start, wait for /health, stop by PID."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from connector.tools.procgroup import stop_process_group
from connector.tools.stack import free_port, tail_lines

START_TIMEOUT_S = 30.0


@dataclass
class Collector:
    url: str  # OTLP endpoint base: the exporter appends /v1/traces
    run_dir: Path
    pid: int

    def files(self) -> list[Path]:
        return sorted(self.run_dir.glob("traces-collector-*.jsonl"))

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5.0, trust_env=False).json()


@contextlib.contextmanager
def running_collector(run_dir: Path) -> Iterator[Collector]:
    port = free_port()
    log = run_dir / "collector.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "connector.cli",
                "collect",
                "--port",
                str(port),
                "--run-dir",
                str(run_dir),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                if proc.poll() is not None:
                    raise AssertionError(
                        f"collector exited {proc.returncode}:\n{tail_lines(log, 30)}"
                    )
                try:
                    if httpx.get(f"{url}/health", timeout=1.0, trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"collector not healthy after {START_TIMEOUT_S:.0f} s:\n"
                        f"{tail_lines(log, 30)}"
                    )
                time.sleep(0.1)
            yield Collector(url, run_dir, proc.pid)
        finally:
            stop_process_group(proc, 10.0)
