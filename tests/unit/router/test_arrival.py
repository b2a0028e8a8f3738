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

    def __init__(self, expect: int = 2) -> None:
        self.seen: dict[str, tuple[arrival.Arrival | None, int]] = {}
        self.done = asyncio.Event()
        self.expect = expect

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.seen[scope["path"]] = (arrival.arrival_of(scope), time.time_ns())
        if scope["path"] == "/stall":
            time.sleep(STALL_S)  # the stall under test, not a synchronisation
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        if len(self.seen) == self.expect:
            self.done.set()


def _request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n".encode()


def _read_answer(c: socket.socket) -> None:
    """One 204 answer's head (the connection stays open: keep-alive)."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = c.recv(4096)
        assert chunk, "the server closed the connection"
        got += chunk


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
    (stall, stall_run), (queued, queued_run) = app.seen["/stall"], app.seen["/queued"]
    assert stall is not None and queued is not None, "the server stamped both"
    assert stall.first_bytes_ns <= stall_run and queued.first_bytes_ns <= stall_run, (
        "both stamped before any handler"
    )
    assert queued_run - queued.first_bytes_ns >= STALL_S * 1e9, "the queued one's wait shows"
    for a in (stall, queued):  # each came on a connection opened for it
        assert a.connected_ns is not None and a.connected_ns <= a.first_bytes_ns
        assert a.start_ns == a.connected_ns


async def test_only_a_connections_first_request_starts_at_its_accept() -> None:
    app = Recording(expect=2)
    server = await InLoopServer(app, http=arrival.protocol()).start()
    port = int(server.url.rsplit(":", 1)[1])
    c = socket.create_connection(("127.0.0.1", port))
    try:
        c.sendall(_request("/first"))
        await within(asyncio.to_thread(_read_answer, c), "the first answer")
        c.sendall(_request("/second"))  # the same connection, kept alive
        await within(app.done.wait(), "the second request")
    finally:
        c.close()
        await server.stop()
    first, second = app.seen["/first"][0], app.seen["/second"][0]
    assert first is not None and first.connected_ns is not None
    assert second is not None and second.connected_ns is None
    assert second.start_ns == second.first_bytes_ns > first.first_bytes_ns


def test_a_connection_opened_long_before_its_request_is_no_part_of_it() -> None:
    t = 10**18
    assert arrival.stamp(t, t - 5_000_000) == arrival.Arrival(t, t - 5_000_000)
    window = arrival.CONNECT_WINDOW_NS
    assert arrival.stamp(t, t - window) == arrival.Arrival(t, t - window)
    assert arrival.stamp(t, t - window - 1) == arrival.Arrival(t)  # a pool kept warm
    assert arrival.stamp(t, None) == arrival.Arrival(t)  # not the connection's first
    assert arrival.stamp(t, t + 1) == arrival.Arrival(t)  # clocks stepped: not trusted


def test_without_a_stamp_there_is_no_arrival() -> None:
    assert arrival.arrival_of({"type": "http"}) is None
    assert arrival.arrival_of({"type": "http", "extensions": {}}) is None
