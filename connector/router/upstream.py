"""The router's HTTP client to one backend (P or D): a thin adapter over aiohttp.

Owns: ``Upstream`` (one connection pool per backend, its timeouts and the backends' own API
key), ``Reply`` (a whole answer), ``Stream`` (an answer whose body is relayed as it comes;
closing it early closes the connection, which is how vLLM learns to abort the request) and
``TransportError`` (every client failure, with its kind: connect, timeout or other).

Why aiohttp: the legs' client was most of the router's CPU under load. httpx cost ~2.6 ms of
CPU per streamed request against ~0.3 ms for aiohttp (same fake backend, bursts of 16), and
the router is one event loop: a request waits for every other request's client work before
its handler runs (``python -m bench.router_cost`` measures the router as a whole).

Must not import: starlette, uvicorn, ``connector.router.app`` / ``relay``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

Kind = Literal["connect", "timeout", "other"]


class TransportError(Exception):
    """The backend could not be reached, did not answer in time, or broke the answer."""

    def __init__(self, kind: Kind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _transport_error(exc: BaseException) -> TransportError:
    if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
        return TransportError("connect", str(exc) or type(exc).__name__)
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return TransportError("timeout", str(exc) or type(exc).__name__)
    return TransportError("other", repr(exc))


@dataclass(frozen=True)
class Reply:
    status_code: int
    content_type: str | None
    content: bytes

    def json(self) -> Any:
        """The body as JSON (``ValueError`` when it is not)."""
        return json.loads(self.content)


class Stream:
    """An answer whose status and headers are in and whose body is still coming."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status_code = resp.status
        self.content_type: str | None = resp.headers.get("content-type")

    async def next_chunk(self) -> bytes | None:
        """The body's next bytes as they arrive, None at its end (``TransportError`` if the
        backend breaks it off)."""
        try:
            chunk = await self._resp.content.readany()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _transport_error(exc) from exc
        return chunk or None

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _transport_error(exc) from exc

    def close(self) -> None:
        """Drop the connection unless the body was read whole (then it is back in the pool
        already): a backend sees an early close as the client gone and aborts."""
        self._resp.close()


class Upstream:
    """One backend's client. ``start`` and ``close`` run on the serving loop."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        max_connections: int,
        keepalive_expiry_s: float,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # connect: waiting for a pooled connection and making one (httpx's pool timeout was
        # the leg's timeout too); sock_read: between bytes, so a slow stream is fine
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=timeout_s, sock_connect=connect_timeout_s, sock_read=timeout_s
        )
        self._limits = (max_connections, keepalive_expiry_s)
        # The backends' own API key (vLLM --api-key), never the client's.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        limit, keepalive = self._limits
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=limit, keepalive_timeout=keepalive),
            timeout=self._timeout,
            headers=self._headers,
            trust_env=False,  # never route P/D traffic through an HTTP(S)_PROXY
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def is_closed(self) -> bool:
        return self._session is None or self._session.closed

    def _s(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError(f"{self.base_url}: router not started (no HTTP client)")
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Reply:
        """A whole answer; ``timeout_s`` bounds all of it (else the client's timeouts)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else self._timeout
        try:
            resp = await self._s().request(
                method, self.base_url + path, json=body, headers=headers, timeout=timeout
            )
            try:
                content = await resp.read()
            except BaseException:
                resp.close()  # cancelled or broken mid-answer: the backend must see us go
                raise
            return Reply(resp.status, resp.headers.get("content-type"), content)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _transport_error(exc) from exc

    async def open(
        self, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> Stream:
        """POST and return once the status and headers are in (the body not read yet)."""
        try:
            resp = await self._s().post(self.base_url + path, json=body, headers=headers)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _transport_error(exc) from exc
        return Stream(resp)
