"""The router's HTTP client to one backend (P or D): a thin adapter over aiohttp, and one
leg sent through it.

Owns: ``Upstream`` (one connection pool per backend, its timeouts and the backends' own API
key), ``Reply`` (a whole answer), ``Stream`` (an answer whose body is relayed as it comes;
closing it early closes the connection, which is how vLLM learns to abort the request),
``TransportError`` (every client failure, with its kind: connect, timeout or other),
``UpstreamError`` (a failed leg and the answer it becomes), and the two ways a leg is sent:
``post_json`` (P's whole answer) and ``open_stream`` (D's answer, relayed as it comes).

Why aiohttp: the legs' client was most of the router's CPU under load. httpx cost ~2.6 ms of
CPU per streamed request against ~0.3 ms for aiohttp (same fake backend, bursts of 16), and
the router is one event loop: a request waits for every other request's client work before
its handler runs (``python -m bench.router_cost`` measures the router as a whole).

Must not import: starlette, uvicorn, ``connector.router.app`` / ``relay``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import aiohttp

from connector.core.errors import PushkvError

logger = logging.getLogger(__name__)
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


class UpstreamError(PushkvError):
    """A leg failed. ``body`` is the backend's own error body when it answered an error
    status (passed through as is); otherwise the router writes an OpenAI-style error.
    ``suspect``: the backend is at fault (not a 4xx refusal of the request)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        backend: str | None = None,
        body: bytes | None = None,
        content_type: str | None = None,
        suspect: bool = True,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.backend = status, message, backend
        self.body, self.content_type, self.suspect = body, content_type, suspect

    def error_json(self) -> dict[str, Any]:
        kind = {502: "upstream_error", 503: "service_unavailable", 504: "upstream_timeout"}
        return {
            "error": {
                "message": self.message,
                "type": kind.get(self.status, "upstream_error"),
                "code": self.status,
                "backend": self.backend,
            }
        }

    def http_body(self) -> tuple[bytes, str]:
        if self.body is not None:
            return self.body, self.content_type or "application/json"
        return json.dumps(self.error_json()).encode(), "application/json"

    def sse(self) -> bytes:
        """How a stream that already started ends when a leg fails."""
        return b"data: " + json.dumps(self.error_json()).encode() + b"\n\ndata: [DONE]\n\n"


class Target(Protocol):
    """The backend a leg goes to (``backends.Backend``)."""

    @property
    def name(self) -> str: ...

    @property
    def http(self) -> Upstream: ...

    def record_leg_failure(self, *, suspect: bool) -> None: ...


def from_exception(exc: BaseException, backend: Target, what: str) -> UpstreamError:
    """Map a transport failure to the answer the client gets: timeout 504, else 502."""
    kind = exc.kind if isinstance(exc, TransportError) else None
    if kind == "connect":
        return UpstreamError(
            502, f"cannot connect to {backend.name} ({what}): {exc}", backend=backend.name
        )
    if kind == "timeout" or isinstance(exc, TimeoutError):
        return UpstreamError(504, f"{backend.name} timed out ({what})", backend=backend.name)
    return UpstreamError(502, f"{backend.name} failed ({what}): {exc}", backend=backend.name)


def _from_status(
    status: int, content_type: str | None, body: bytes, backend: Target, what: str
) -> UpstreamError:
    return UpstreamError(
        status,
        f"{backend.name} answered {status} ({what})",
        backend=backend.name,
        body=body,
        content_type=content_type,
        suspect=status >= 500,
    )


async def post_json(
    backend: Target,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    deadline_s: float,
    what: str,
) -> dict[str, Any]:
    """One non-streamed leg with a whole-leg deadline; returns the JSON answer."""
    try:
        try:
            async with asyncio.timeout(deadline_s):
                resp = await backend.http.request("POST", path, body=body, headers=headers)
        except (TransportError, TimeoutError) as exc:
            raise from_exception(exc, backend, what) from exc
        if resp.status_code >= 400:
            raise _from_status(resp.status_code, resp.content_type, resp.content, backend, what)
        try:
            answer = resp.json()
        except ValueError:
            raise UpstreamError(
                502, f"{backend.name} sent invalid JSON ({what})", backend=backend.name
            ) from None
        if not isinstance(answer, dict):
            raise UpstreamError(
                502, f"{backend.name} sent a non-object ({what})", backend=backend.name
            )
        return answer
    except UpstreamError as err:
        backend.record_leg_failure(suspect=err.suspect)
        logger.warning("router %s leg failed: %s", what, err.message)
        raise


async def open_stream(
    backend: Target,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    what: str,
    *,
    record: bool = True,
) -> Stream:
    """Send a leg and return once its status and headers are in (body not read yet). An
    error status is read whole and raised as ``UpstreamError`` (passed through).
    ``record``: count the failure against ``backend`` here (else the caller decides whose
    failure it is: ``attempt.Attempt.blame_decode``)."""
    try:
        resp = await backend.http.open(path, body, headers)
    except TransportError as exc:
        err = from_exception(exc, backend, what)
    else:
        if resp.status_code < 400:
            return resp
        try:
            raw = await resp.read()
            err = _from_status(resp.status_code, resp.content_type, raw, backend, what)
        except TransportError as exc:
            err = from_exception(exc, backend, what)
        finally:
            resp.close()
    if record:
        backend.record_leg_failure(suspect=err.suspect)
    logger.warning("router %s leg failed: %s", what, err.message)
    raise err
