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

from tests.unit.router.serving import WAIT_S

# A new interpreter importing the router takes about 1.3 s on an idle 2-core box and was
# seen over 10 s while the suite's vLLM engines held both cores: a bound, not a budget.
START_S = 60.0


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
        sel = selectors.DefaultSelector()
        sel.register(proc.stderr, selectors.EVENT_READ)
        deadline, seen, url = time.monotonic() + START_S, b"", None
        while url is None and time.monotonic() < deadline:
            if sel.select(timeout=deadline - time.monotonic()):
                line = proc.stderr.readline()
                if not line:
                    break  # the process died
                seen += line
                m = re.search(rb"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
                url = m[1].decode() if m else None
        assert url, f"router did not start; stderr so far:\n{seen.decode()}"
        r = httpx.get(f"{url}/health", timeout=WAIT_S, trust_env=False)
        assert r.status_code == 503 and "no healthy prefill" in r.json()["reason"]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=WAIT_S)
        # uvicorn shuts down gracefully, then re-raises the signal it caught (its design).
        assert proc.returncode in (0, -signal.SIGTERM), err.decode()
        assert b"Finished server process" in err, err.decode()
        assert out == b""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
