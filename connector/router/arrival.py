"""When a request reached the router: the HTTP server's own moments, not the handler's.

Owns: ``protocol()``, uvicorn's httptools HTTP protocol with one change: it stamps each
request when the server starts parsing its first bytes (``on_message_begin``, inside the
``data_received`` call that brought them) and, for the first request on a connection the
client opened for it, when the server accepted that connection; ``Arrival`` and
``arrival_of(scope)`` read the stamps back.

Requests that arrive together each get a task, and a task runs only once the ones before it
have reached an ``await``: the time from the first bytes to the handler is the request's
``ingress`` span, time queued on the router's loop (docs/operations.md#tracing). A client
that opens a connection for its request sends it only after its own connection set-up: for
such a request the trace starts at the accept, and the "connection" segment shows that wait.
A request arriving more than ``CONNECT_WINDOW_NS`` after its connection was accepted came
over a connection opened in advance (a pool kept warm): its connection is no part of it.

Without httptools (uvicorn's h11 fallback) there is no stamp and the root span starts in
the handler, as before; the root span's ``pushkv.router.arrival`` says which.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final

from starlette.types import Scope

# scope["extensions"][EXTENSION]["stamp"]: an ``Arrival`` (ASGI extensions are dicts)
EXTENSION: Final = "pushkv.arrival"
CONNECT_WINDOW_NS: Final = 1_000_000_000


@dataclass(frozen=True)
class Arrival:
    """Unix ns: the server began parsing the request; it accepted the request's connection
    (None unless the client opened the connection for this request)."""

    first_bytes_ns: int
    connected_ns: int | None = None

    @property
    def start_ns(self) -> int:
        return self.connected_ns or self.first_bytes_ns


def stamp(first_bytes_ns: int, accepted_ns: int | None) -> Arrival:
    """The arrival of a request; ``accepted_ns``: its connection's accept, when this is the
    connection's first request (else None)."""
    if accepted_ns is not None and 0 <= first_bytes_ns - accepted_ns <= CONNECT_WINDOW_NS:
        return Arrival(first_bytes_ns, accepted_ns)
    return Arrival(first_bytes_ns)


def protocol() -> Any:
    """The ``http`` setting for ``uvicorn.run``: the stamping protocol class, or "auto"."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: uvicorn falls back to h11, unstamped
        return "auto"

    class ArrivalProtocol(HttpToolsProtocol):
        _accepted_ns: int | None = None

        def connection_made(self, transport: Any) -> None:
            self._accepted_ns = time.time_ns()
            super().connection_made(transport)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            accepted, self._accepted_ns = self._accepted_ns, None  # the first request only
            self.scope["extensions"] = {EXTENSION: {"stamp": stamp(time.time_ns(), accepted)}}

    return ArrivalProtocol


def arrival_of(scope: Scope) -> Arrival | None:
    """The request's stamps, None when the server did not stamp it."""
    found = ((scope.get("extensions") or {}).get(EXTENSION) or {}).get("stamp")
    return found if isinstance(found, Arrival) else None
