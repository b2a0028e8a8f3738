"""When a request reached the router: the HTTP server's own moment, not the handler's.

Owns: ``protocol()``, uvicorn's httptools HTTP protocol with one change: it stamps each
request when the server starts parsing its first bytes (``on_message_begin``, inside the
``data_received`` call that brought them), and ``arrival_ns(scope)``, which reads the stamp.
Requests that arrive together each get a task, and a task runs only once the ones before
it have reached an ``await``: the time from this stamp to the handler's start is the
"router ingress" segment (issue #18), invisible when the root span started in the handler.

Without httptools (uvicorn's h11 fallback) there is no stamp and the root span starts in
the handler, as before; the root span's ``pushkv.router.arrival`` says which.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.types import Scope

EXTENSION = "pushkv.arrival"  # scope["extensions"][EXTENSION] = {"time_ns": unix ns}


def protocol() -> Any:
    """The ``http`` setting for ``uvicorn.run``: the stamping protocol class, or "auto"."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: uvicorn falls back to h11, unstamped
        return "auto"

    class ArrivalProtocol(HttpToolsProtocol):
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope["extensions"] = {EXTENSION: {"time_ns": time.time_ns()}}

    return ArrivalProtocol


def arrival_ns(scope: Scope) -> int | None:
    """The request's stamp (unix ns), None when the server did not stamp it."""
    stamp = (scope.get("extensions") or {}).get(EXTENSION)
    return stamp.get("time_ns") if isinstance(stamp, dict) else None
