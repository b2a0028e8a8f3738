"""Serving ASGI apps on 127.0.0.1 inside the test's own event loop, and bounded waits.

Owns: ``InLoopServer`` (uvicorn without its 0.1 s ticks, signal capture or grace sleep, so a
test starts and stops several servers in milliseconds; the apps share the test's loop, so
mocks and tests synchronise with plain ``asyncio.Event``s), ``within``, ``until`` and
``LoopClock`` (the loop's clock moved forward by the test, for deadlines under test).
Real sockets because httpx's ASGITransport buffers whole responses: streaming and
disconnects need a real connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import anyio
import pytest
import uvicorn

T = TypeVar("T")

WAIT_S = 5.0  # every bounded wait in these tests; they finish in milliseconds when green


async def within(aw: Awaitable[T], what: str, timeout_s: float = WAIT_S) -> T:
    """Await ``aw`` or fail the test saying what did not happen."""
    try:
        with anyio.fail_after(timeout_s):
            return await aw
    except TimeoutError:
        pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


async def until(cond: Callable[[], bool], what: str) -> None:
    """Poll ``cond`` (state of the code under test, no event to wait on) within ``WAIT_S``."""

    async def poll() -> None:
        while not cond():
            await asyncio.sleep(0.005)  # pacing of the poll, not synchronisation

    await within(poll(), what)


class LoopClock:
    """The running loop's clock, moved forward only by the test: a deadline under test fires
    when ``advance`` passes it, never early because a loaded machine was slow to get the
    legs there. Every asyncio, anyio and aiohttp timer reads ``loop.time()``.

    Never moved back (not even at teardown): timers already scheduled would stall."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        real = loop.time
        self.skipped_s = 0.0
        loop.time = lambda: real() + self.skipped_s  # type: ignore[method-assign]

    def advance(self, seconds: float) -> None:
        """Every timer due within ``seconds`` fires on the loop's next turn."""
        self.skipped_s += seconds


class InLoopServer(uvicorn.Server):
    def __init__(self, app: Any, http: Any = "auto") -> None:
        super().__init__(
            uvicorn.Config(
                app,
                lifespan="on",
                log_level="warning",
                access_log=False,
                timeout_keep_alive=30,
                http=http,
            )
        )
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only when the
        # listener says so (proto 0 would leave Nagle on: ~40 ms per reused connection).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # leave pytest's signal handlers alone

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self._ready.set()

    async def main_loop(self) -> None:
        await self._stop.wait()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for conn in list(self.server_state.connections):
            conn.shutdown()
        tasks = set(self.server_state.tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=WAIT_S)
            for t in pending:
                t.cancel()
        await self.lifespan.shutdown()

    async def start(self) -> InLoopServer:
        self._task = asyncio.create_task(self.serve(sockets=[self.sock]))
        ready = asyncio.ensure_future(self._ready.wait())
        done, _ = await asyncio.wait(
            {ready, self._task}, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED
        )
        if ready not in done:
            ready.cancel()
            raise RuntimeError(f"server at {self.url} did not start")
        return self

    async def stop(self) -> None:
        if self._task is None:
            return
        self._stop.set()
        task, self._task = self._task, None
        await within(task, f"server {self.url} to stop")
        self.sock.close()
