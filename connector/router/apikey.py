"""The router's own API key: an ASGI middleware that lets through only requests bearing it.

Owns: ``ApiKeyGate`` (OpenAI-style ``Authorization: Bearer <key>``, compared in constant
time with ``hmac.compare_digest``; every route but the open ones, ``/health`` by default,
answers 401 without it), ``bearer`` (the token of a header) and ``forwarded_authorization``
(the client's header never reaches a backend when a key is set; the backends' own key is
``RouterConfig.backend_api_key``). TLS is terminated in front of the router
(docs/security.md).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

if TYPE_CHECKING:
    from connector.router.config import RouterConfig

_BODY = json.dumps(
    {
        "error": {
            "message": "missing or wrong API key (send 'Authorization: Bearer <key>')",
            "type": "invalid_request_error",
            "code": 401,
        }
    }
).encode()


def bearer(header: bytes | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return None
    return token.strip()


def forwarded_authorization(config: RouterConfig, header: str | None) -> str | None:
    """The client's header goes to the backends only while the router has no keys of its
    own: with ``--api-key`` it holds the router's key, and a backend key replaces it."""
    return None if config.api_key or config.backend_api_key else header


class ApiKeyGate:
    def __init__(
        self,
        app: ASGIApp,
        key: str,
        open_paths: frozenset[str] = frozenset({"/health"}),
        on_reject: Callable[[], None] | None = None,
    ) -> None:
        if not key:
            raise ValueError("an empty API key protects nothing")
        self.app, self._key, self.open_paths = app, key.encode(), open_paths
        self._on_reject = on_reject

    def allowed(self, scope: Scope) -> bool:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return True  # lifespan and websockets carry no request; health stays open
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        token = bearer(header)
        return token is not None and hmac.compare_digest(token, self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.allowed(scope):
            await self.app(scope, receive, send)
            return
        if self._on_reject is not None:
            self._on_reject()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                    (b"content-length", str(len(_BODY)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _BODY})
