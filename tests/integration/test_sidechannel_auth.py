"""The side channel with a shared secret, over real sockets on 127.0.0.1 (no NIXL):
matching secrets exchange metadata; a missing, wrong or unexpected secret, a replayed
request or a replayed reply is dropped and counted, nothing of it reaches the inbox, the
requester gets nothing of ours, and the server keeps serving."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from connector.core import auth
from connector.transport.sidechannel import SideChannel
from connector.transport.sidechannel_wire import (
    KIND_EXCHANGE,
    KIND_REPLY,
    FrameReader,
    encode_frame,
)

pytestmark = [pytest.mark.timeout(60)]

KEY = b"k" * 32
OTHER = b"o" * 32


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.002)


def raw_exchange(addr: tuple[str, int], payload: bytes, timeout_s: float = 5.0) -> bytes:
    """Send ``payload``, read until the server closes (bounded); a reset counts as closed."""
    got = b""
    with socket.create_connection(addr, timeout=timeout_s) as s:
        try:
            s.sendall(payload)
            while chunk := s.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
    return got


@pytest.fixture
def channel() -> Iterator[Callable[..., SideChannel]]:
    made: list[SideChannel] = []

    def make(name: str, key: bytes | None, md: bytes | None = None, **kw: Any) -> SideChannel:
        sc = SideChannel(name, "127.0.0.1", 0, key=key, **kw)
        sc.set_local_metadata(md if md is not None else f"MD-{name}".encode())
        made.append(sc)
        return sc

    yield make
    for sc in made:
        sc.close()


def dial(client: SideChannel, server: SideChannel) -> str:
    """``client`` dials ``server``; "ok" or the client's last error, once the dial ended."""
    client.request(server.name, *server.address)
    wait_until(
        lambda: sum(v for k, v in client.counters.items() if k.startswith("dials_")) > 0,
        "the dial to end",
    )
    return "ok" if client.counters.get("dials_ok") else str(client.last_error(server.name))


def test_matching_secrets_exchange_plain_metadata(channel: Callable[..., SideChannel]) -> None:
    srv, cli = channel("srv", KEY), channel("cli", KEY)
    assert dial(cli, srv) == "ok"
    assert [(p.peer, p.metadata, p.via) for p in cli.drain()] == [("srv", b"MD-srv", "reply")]
    assert [(p.peer, p.metadata) for p in srv.drain()] == [("cli", b"MD-cli")]


@pytest.mark.parametrize(
    "server_key, client_key, dropped",
    [
        (KEY, None, "dropped_auth_missing"),  # a requester without the secret
        (KEY, OTHER, "dropped_auth_bad_tag"),  # another secret
        (None, KEY, "dropped_auth_unexpected"),  # we have none: never load a sealed blob
    ],
)
def test_mismatched_secret_is_dropped_and_the_server_keeps_serving(
    channel: Callable[..., SideChannel],
    server_key: bytes | None,
    client_key: bytes | None,
    dropped: str,
) -> None:
    srv, cli = channel("srv", server_key), channel("cli", client_key)
    assert dial(cli, srv) != "ok"
    assert srv.counters.get(dropped) == 1
    assert srv.drain() == [] and cli.drain() == []  # nothing loaded on either side
    good = channel("good", server_key)
    assert dial(good, srv) == "ok"  # still serving
    assert [p.peer for p in srv.drain()] == ["good"]


def sealed_request(name: str, key: bytes, nonce: int = 1) -> tuple[bytes, bytes]:
    stamp = auth.Stamp(time.time_ns() // 1_000_000, nonce.to_bytes(16, "big"))
    md = auth.seal(key, auth.SIDE_EXCHANGE, b"MD-" + name.encode(), stamp, name.encode())
    return encode_frame(KIND_EXCHANGE, name, md, 1 << 20), stamp.nonce


def test_a_replayed_request_is_refused(channel: Callable[..., SideChannel]) -> None:
    srv = channel("srv", KEY)
    request, nonce = sealed_request("cli", KEY)
    reply = FrameReader(1 << 20).feed(raw_exchange(srv.address, request))
    assert reply is not None and reply.kind == KIND_REPLY
    # The reply is sealed for this request's nonce.
    body, _ = auth.unseal(
        KEY, auth.SIDE_REPLY, reply.metadata, time.time_ns() // 1_000_000, 60_000, b"srv" + nonce
    )
    assert body == b"MD-srv"
    assert raw_exchange(srv.address, request) == b""  # the same bytes again: no answer
    assert srv.counters.get("dropped_auth_replayed") == 1
    assert [p.peer for p in srv.drain()] == ["cli"]  # loaded once


def test_a_replayed_reply_fails_the_dial(channel: Callable[..., SideChannel]) -> None:
    """A reply recorded for one request answers no other: an impostor listening where the
    client dials cannot hand it the real peer's (old) metadata."""
    srv = channel("srv", KEY)
    request, _ = sealed_request("cli", KEY)
    recorded = raw_exchange(srv.address, request)
    with socket.create_server(("127.0.0.1", 0)) as impostor:
        port = impostor.getsockname()[1]

        def answer() -> None:
            conn, _ = impostor.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(recorded)

        t = threading.Thread(target=answer, daemon=True)
        t.start()
        cli = channel("cli", KEY)
        cli.request("srv", "127.0.0.1", port)
        wait_until(
            lambda: cli.last_error("srv") not in (None, "a dial is in flight, no answer yet"),
            "the dial to fail",
        )
        t.join(5)
    assert cli.counters.get("dials_failed_auth_bad_tag") == 1
    assert cli.drain() == []
