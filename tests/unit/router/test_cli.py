"""``main(argv)`` in a real process: it serves, logs to stderr only, and stops on SIGTERM."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time

import httpx

# A new interpreter importing the router takes about 1.3 s on an idle 2-core box and was
# seen over 10 s while the suite's vLLM engines held both cores: a bound, not a budget.
START_S = 120.0
STOP_S = 30.0  # its /health answer and its exit on SIGTERM: milliseconds idle, a bound too


def _announced_url(fd: int) -> tuple[str | None, bytes]:
    """The URL uvicorn logs once it listens, read from stderr's raw fd (a buffered
    ``readline`` after ``select`` can leave that line in Python's buffer, unseen, until the
    deadline), and all stderr read so far; ``None`` if the process exits or ``START_S``
    passes first."""
    deadline, seen = time.monotonic() + START_S, b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not sel.select(timeout=left):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break  # the process closed stderr: it died
            seen += chunk
            if m := re.search(rb"Uvicorn running on (http://127\.0\.0\.1:\d+)", seen):
                return m[1].decode(), seen
    return None, seen


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_main_serves_and_prints_nothing_to_stdout() -> None:
    dead = f"http://127.0.0.1:{_closed_port()}"
    code = "import sys; from connector.router import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "--prefill",
            dead,
            "--decode",
            dead,
            "--port",
            "0",
            "--health-timeout",
            "0.2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=os.getcwd(),
    )
    try:
        assert proc.stderr is not None
        url, seen = _announced_url(proc.stderr.fileno())
        assert url, (
            f"router did not say where it serves within {START_S:.0f} s "
            f"(exit code {proc.poll()}); stderr so far:\n{seen.decode(errors='replace')}"
        )
        r = httpx.get(f"{url}/health", timeout=STOP_S, trust_env=False)
        assert r.status_code == 503 and "no healthy prefill" in r.json()["reason"]
        proc.send_signal(signal.SIGTERM)
        out, rest = proc.communicate(timeout=STOP_S)
        err = seen + rest
        # uvicorn shuts down gracefully, then re-raises the signal it caught (its design).
        assert proc.returncode in (0, -signal.SIGTERM), err.decode()
        assert b"Finished server process" in err, err.decode()
        assert out == b""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
