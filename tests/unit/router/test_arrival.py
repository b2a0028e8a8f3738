"""The router's arrival stamp (connector/router/arrival.py): requests that arrive together
wait for each other's handlers on the event loop, and the stamp shows that wait."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest

from connector.router import arrival
from tests.unit.router.serving import InLoopServer, within

pytestmark = pytest.mark.anyio

STALL_S = 0.05  # a handler that holds the loop this long (standing in for CPU work)


class Recording:
    """An ASGI app that records each request's stamp and handler start; the request whose
    path is /stall holds the loop for STALL_S before answering."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[int | None, int]] = {}
        self.done = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.seen[scope["path"]] = (arrival.arrival_ns(scope), time.time_ns())
        if scope["path"] == "/stall":
            time.sleep(STALL_S)  # the stall under test, not a synchronisation
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        if len(self.seen) == 2:
            self.done.set()


def _request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n".encode()


async def test_a_request_queued_behind_a_stalled_handler_keeps_its_arrival_time() -> None:
    app = Recording()
    server = await InLoopServer(app, http=arrival.protocol()).start()
    conns = []
    try:
        port = int(server.url.rsplit(":", 1)[1])
        # Both requests are in the kernel before the loop runs again: the server reads them
        # in one go, and the second handler runs only after the first one's stall.
        for path in ("/stall", "/queued"):
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(_request(path))
            conns.append(c)
        await within(app.done.wait(), "both requests to reach their handlers")
    finally:
        for c in conns:
            c.close()
        await server.stop()
    (stall_at, stall_run), (queued_at, queued_run) = app.seen["/stall"], app.seen["/queued"]
    assert stall_at is not None and queued_at is not None, "the server stamped both"
    assert stall_at <= stall_run and queued_at <= stall_run, "both stamped before any handler"
    assert queued_run - queued_at >= STALL_S * 1e9, "the queued one's wait is measured"


def test_without_a_stamp_there_is_no_arrival() -> None:
    assert arrival.arrival_ns({"type": "http"}) is None
    assert arrival.arrival_ns({"type": "http", "extensions": {}}) is None
