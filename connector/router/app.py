"""The router's ASGI app (Starlette) and its ``main``.

Owns: ``RouterState`` (everything one app instance holds: backends, in-flight background
tasks, counters; no module globals), ``create_app(config)``, the endpoints
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/router/stats``), the client-disconnect watch, and ``main(argv)`` (uvicorn).

Must not import: vLLM, NIXL, torch (the router runs in its own process, next to neither).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from connector.router import legs
from connector.router.backends import Backends, Role
from connector.router.config import RouterConfig, parse_args
from connector.router.relay import SSE_DONE, Dispatch, from_exception
from connector.router.tracing import RequestTrace
from telemetry.schema import Outcome

logger = logging.getLogger(__name__)


class RouterState:
    """One router instance's state; lives on ``app.state.router``."""

    def __init__(self, config: RouterConfig, tracer: Any = None) -> None:
        self.config = config
        self.tracer = tracer  # None: tracing off
        self.backends = Backends(config)
        # P legs still running after D's answer went out (see relay.Dispatch._cleanup).
        self.background: set[asyncio.Task[Any]] = set()
        self.responses: Counter[int] = Counter()

    async def start(self) -> None:
        await self.backends.start()
        logger.info(
            "router up: mode=%s prefill=%s decode=%s",
            self.config.mode.value,
            list(self.config.prefill_urls),
            list(self.config.decode_urls),
        )

    async def stop(self) -> None:
        tasks = list(self.background)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.backends.stop()

    def stats(self) -> dict[str, Any]:
        return {
            "mode": self.config.mode.value,
            "requests": {
                "total": sum(self.responses.values()),
                "by_status": {str(k): v for k, v in sorted(self.responses.items())},
            },
            "background_prefill_legs": len(self.background),
            **self.backends.stats(),
        }


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status
    )


class _Exchange:
    """What the endpoint learns while it answers: the status sent, whether the client left."""

    def __init__(self, send: Send, state: RouterState) -> None:
        self._send, self._state = send, state
        self.status: int | None = None
        self.complete = False
        self.disconnected = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self._state.responses[message["status"]] += 1
        elif message["type"] == "http.response.body" and (
            not message.get("more_body") or message.get("body", b"").endswith(SSE_DONE)
        ):
            # A client may hang up as soon as it has the stream's last event.
            self.complete = True
        await self._send(message)

    async def watch_disconnect(self, receive: Receive, scope: anyio.CancelScope) -> None:
        """The request body has been read, so the next message is the disconnect (uvicorn
        also sends it once the response is complete; by then cancelling is harmless)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected = not self.complete
                scope.cancel()
                return


class ProxyEndpoint:
    """``POST /v1/completions`` and ``/v1/chat/completions``, as a raw ASGI app: it must
    watch for the client's disconnect while it waits on the legs, which a Starlette
    request/response endpoint does not do."""

    def __init__(self, state: RouterState, endpoint: legs.Endpoint) -> None:
        self.state, self.endpoint = state, endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        request = Request(scope, receive)
        trace = RequestTrace(
            state.tracer,
            request.headers.get("traceparent"),
            mode=state.config.mode.value,
            endpoint=self.endpoint.name.lower(),
        )
        exchange = _Exchange(send, state)
        error: str | None = None
        try:
            error = await self._answer(scope, receive, request, trace, exchange)
        except BaseException:
            error = Outcome.CANCELLED.value if exchange.disconnected else "router_error"
            raise
        finally:
            if exchange.disconnected:
                error = Outcome.CANCELLED.value  # the client left before the answer was complete
            try:
                trace.end(exchange.status, error)
            except Exception:  # telemetry must never break serving
                logger.exception("Ending the request's spans failed")

    async def _answer(
        self,
        scope: Scope,
        receive: Receive,
        request: Request,
        trace: RequestTrace,
        exchange: _Exchange,
    ) -> str | None:
        """Serve one request; returns why it failed before any leg ran, if it did."""
        state, counted = self.state, exchange.send
        try:
            raw = await request.body()
        except ClientDisconnect:
            return Outcome.CANCELLED.value
        try:
            body = legs.parse_client_body(raw, self.endpoint)
        except legs.InvalidRequest as exc:
            await error_response(400, str(exc), "invalid_request_error")(scope, receive, counted)
            return "invalid_request"
        request_id = legs.request_id_from(request.headers.get("x-request-id"))
        trace.request_parsed(body, request_id)
        route_start = time.time_ns()
        backends = state.backends
        reason = backends.unavailable_reason()
        p = backends.acquire(Role.PREFILL) if reason is None else None
        d = backends.acquire(Role.DECODE) if p is not None else None
        if p is None or d is None:
            if p is not None:
                p.release()
            reason = reason or "no healthy backend"
            trace.routed(route_start, None, None, None, error="no_backend")
            await error_response(503, reason, "service_unavailable")(scope, receive, counted)
            return "no_backend"
        trace.routed(route_start, p.backend.url, d.backend.url, d.backend.load.outstanding)
        dispatch = Dispatch(
            state.config,
            self.endpoint,
            body,
            p,
            d,
            request_id=request_id,
            trace=trace,
            authorization=request.headers.get("authorization"),
            background=state.background,
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(exchange.watch_disconnect, receive, tg.cancel_scope)
            try:
                await dispatch.serve(counted)
            finally:
                tg.cancel_scope.cancel()
        return None


def create_app(
    config: RouterConfig, tracer: Any = None, on_shutdown: Callable[[], Any] | None = None
) -> Starlette:
    """The router as an ASGI app. Its lifespan opens the backend clients, runs a first
    health round (and the probes) and starts the health loop; shutdown closes them.
    ``tracer``: an OpenTelemetry tracer for the request spans; None, tracing off.
    ``on_shutdown``: runs last at shutdown (the span flush: uvicorn ends the process by
    re-raising the signal, so atexit handlers never run)."""
    state = RouterState(config, tracer)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()
            if on_shutdown is not None:
                on_shutdown()

    async def health(_request: Request) -> Response:
        reason = state.backends.unavailable_reason()
        if reason is not None:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        b = state.backends
        return JSONResponse(
            {
                "status": "ok",
                "mode": config.mode.value,
                "prefill_eligible": sum(x.load.eligible for x in b.prefill),
                "decode_eligible": sum(x.load.eligible for x in b.decode),
            }
        )

    async def models(_request: Request) -> Response:
        d = state.backends.pick(Role.DECODE)
        if d is None:
            return error_response(503, "no healthy decode server", "service_unavailable")
        try:
            r = await d.http.get("/v1/models")
        except httpx.HTTPError as exc:
            err = from_exception(exc, d, "/v1/models")
            body, ctype = err.http_body()
            return Response(body, status_code=err.status, media_type=ctype)
        return Response(
            r.content,
            status_code=r.status_code,
            media_type=r.headers.get("content-type", "application/json"),
        )

    async def stats(_request: Request) -> Response:
        return JSONResponse(state.stats())

    app = Starlette(
        routes=[
            Route(
                "/v1/completions", ProxyEndpoint(state, legs.Endpoint.COMPLETIONS), methods=["POST"]
            ),
            Route(
                "/v1/chat/completions", ProxyEndpoint(state, legs.Endpoint.CHAT), methods=["POST"]
            ),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/router/stats", stats, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.router = state
    return app


def main(argv: list[str]) -> int:
    """``pushkv router ...``: ``argv`` is what follows ``router``. Serves until interrupted."""
    config = parse_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import uvicorn  # only the serving process needs it

    from telemetry.schema import Service
    from telemetry.setup import setup_tracing

    provider = setup_tracing(Service.ROUTER.value, role="router")
    tracer = provider.get_tracer("pushkv.router") if provider is not None else None
    uvicorn.run(
        create_app(config, tracer, on_shutdown=provider.shutdown if provider is not None else None),
        host=config.host,
        port=config.port,
        access_log=False,
        log_level=config.log_level,
        lifespan="on",
    )
    return 0
