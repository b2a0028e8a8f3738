"""SIGTERM drains a real router process (``connector/router/serve.py``): the request in
flight completes, new ones and ``/health`` are refused 503 "draining", and the process exits
once nothing is in flight, or when ``--drain-timeout`` has passed. The mock P and D serve in
the test's loop; the router is a child process, stopped by its PID in a ``finally``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.unit.router.conftest import MakeCluster
from tests.unit.router.serving import WAIT_S, within
from tests.unit.router.test_choice_and_modes import COMPLETION
from tests.unit.router.test_cli import START_S

pytestmark = pytest.mark.anyio
CODE = "import sys; from connector.router import main; sys.exit(main(sys.argv[1:]))"


class RouterProcess:
    """A router child process and its log (stderr), read as it comes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.log: list[bytes] = []
        self._line = asyncio.Condition()

    async def read_log(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            async with self._line:
                self.log.append(line)
                self._line.notify_all()
        async with self._line:
            self.log.append(b"")  # end of the log: the process closed stderr
            self._line.notify_all()

    async def wait_log(
        self, pattern: bytes, what: str, timeout_s: float = WAIT_S
    ) -> re.Match[bytes]:
        """The first log line matching ``pattern``; fails the test if the log ends first."""

        async def _wait() -> re.Match[bytes]:
            seen = 0
            async with self._line:
                while True:
                    for line in self.log[seen:]:
                        if line == b"":
                            pytest.fail(f"router exited before {what}:\n{self.text}")
                        if m := re.search(pattern, line):
                            return m
                    seen = len(self.log)
                    await self._line.wait()

        return await within(_wait(), what, timeout_s)

    @property
    def text(self) -> str:
        return b"".join(self.log).decode(errors="replace")


@contextlib.asynccontextmanager
async def router_process(
    p_url: str, d_url: str, drain_timeout_s: float
) -> AsyncIterator[tuple[RouterProcess, str]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CODE,
        *("--prefill", p_url, "--decode", d_url, "--port", "0"),
        *("--drain-timeout", str(drain_timeout_s), "--health-interval", "3600"),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        cwd=os.getcwd(),
    )
    router = RouterProcess(proc)
    reader = asyncio.create_task(router.read_log())
    try:
        m = await router.wait_log(
            rb"Uvicorn running on (http://127\.0\.0\.1:\d+)", "the router to serve", START_S
        )
        yield router, m[1].decode()
    except BaseException:
        sys.stderr.write(router.text)
        raise
    finally:
        if proc.returncode is None:
            proc.kill()  # by its PID: the process this test started
            await proc.wait()
        await within(reader, "the router's log to close")


async def test_sigterm_finishes_the_request_in_flight_and_refuses_new_ones(
    cluster: MakeCluster,
) -> None:
    c = await cluster(1, 1)
    c.d[0].gate = asyncio.Event()
    p_url, d_url = c.p_servers[0].url, c.d_servers[0].url
    async with (
        router_process(p_url, d_url, drain_timeout_s=30.0) as (router, url),
        httpx.AsyncClient(base_url=url, timeout=WAIT_S, trust_env=False) as client,
    ):
        assert (await client.get("/health")).status_code == 200
        in_flight = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
        await c.d[0].wait_for(1, "the request in flight at D")
        router.proc.send_signal(signal.SIGTERM)

        await router.wait_log(rb"SIGTERM: draining", "the router to log its drain")
        h = await client.get("/health")
        assert h.status_code == 503 and h.json() == {"status": "draining", "in_flight": 1}
        r = await client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
        assert router.proc.returncode is None  # still serving the request in flight
        c.d[0].gate.set()
        r = await within(in_flight, "the request in flight to complete")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello from d0"
        code = await within(router.proc.wait(), "the router to exit once drained")
        # uvicorn re-raises the signal it caught after its graceful shutdown (its design).
        assert code in (0, -signal.SIGTERM)
        assert len(c.d[0].requests) == 1


async def test_sigterm_exits_within_the_drain_timeout_with_a_request_stuck(
    cluster: MakeCluster,
) -> None:
    c = await cluster(1, 1)
    c.d[0].gate = asyncio.Event()  # never set: D never answers
    drain_s = 1.0
    async with (
        router_process(c.p_servers[0].url, c.d_servers[0].url, drain_s) as (router, url),
        httpx.AsyncClient(base_url=url, timeout=WAIT_S, trust_env=False) as client,
    ):
        stuck = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
        await c.d[0].wait_for(1, "the stuck request at D")
        start = time.monotonic()
        router.proc.send_signal(signal.SIGTERM)
        code = await within(router.proc.wait(), "the router to exit after its drain timeout")
        took_s = time.monotonic() - start
        assert code in (0, -signal.SIGTERM)
        # The drain timeout, then the cut requests' answers and uvicorn's shutdown.
        assert drain_s <= took_s < drain_s + 3.0, took_s
        r = await within(stuck, "the stuck request to be cut")
        assert r.status_code == 503 and "--drain-timeout" in r.json()["error"]["message"]
        await within(c.d[0].requests[0].disconnected.wait(), "D's leg to be closed")
