"""Fixtures for the integration tests: loopback-only UCX, free ports, child peers.

Owns: the UCX environment defaults (set before any child starts), ``free_port``, and the
``peers`` / ``local_transport`` / ``netbed`` factories, which stop or remove everything they
started (children by PID) at teardown. Must not import nixl at module level.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from connector.tools.netbed import NetBed, Unavailable
from connector.transport.ports import free_port

# Loopback only; tcp must be present (UCX's "peer" error mode needs a transport that can
# detect a dead peer). Children inherit this environment at spawn.
os.environ.setdefault("UCX_TLS", "tcp,sm,self")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from nixl_peers import PeerProcess  # noqa: E402  (after the env defaults, on purpose)


@pytest.fixture
def peers() -> Iterator[Callable[..., PeerProcess]]:
    """Factory: ``peers(name, port=None, nbytes=1 MiB, wait=True)`` -> a started child."""
    started: list[PeerProcess] = []

    def start(
        name: str, port: int | None = None, nbytes: int = 1 << 20, wait: bool = True
    ) -> PeerProcess:
        peer = PeerProcess(name, port or free_port(), nbytes)
        started.append(peer)
        return peer.wait_ready() if wait else peer

    yield start
    for peer in started:
        peer.stop(timeout_s=5.0)


@pytest.fixture
def local_transport() -> Iterator[Callable[..., object]]:
    """Factory for a NixlTransport in the test process; all are closed at teardown."""
    from connector.transport.nixl import NixlTransport

    made: list[NixlTransport] = []

    def make(name: str, port: int | None = None, **kw: Any) -> NixlTransport:
        t = NixlTransport(name, listen_port=port or free_port(), **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


@pytest.fixture
def netbed() -> Iterator[Callable[[int], NetBed]]:
    """Factory: ``netbed(n)`` -> ``n`` simulated hosts (``connector.tools.netbed``); skips
    where namespaces cannot be made; removed at teardown, and checked to be gone."""
    made: list[NetBed] = []

    def make(n: int) -> NetBed:
        bed = NetBed(n)
        try:
            bed.__enter__()
        except Unavailable as exc:
            pytest.skip(str(exc))
        made.append(bed)
        return bed

    yield make
    for bed in made:
        bed.close()
    assert not [name for bed in made for name in bed.leftovers()], "a bed left names behind"
