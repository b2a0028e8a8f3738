"""The router's ASGI app (Starlette) and its ``main``.

Owns: ``RouterState`` (everything one app instance holds: backends, in-flight background
tasks, counters; no module globals), ``create_app(config)``, the endpoints
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/router/stats``, ``/metrics``; ``/admin/``: ``drain.py``, ``membership.py``), the ids and
timings every answer carries (``traceresponse``, ``Server-Timing``), the client-disconnect
watch, and ``main(argv)`` (``serve.py``: uvicorn, the drain on SIGTERM). Each request's
attempts are ``relay.serve_request``'s.

Must not import: vLLM, NIXL, torch (the router runs in its own process, next to neither).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from connector.router import arrival, legs, priority
from connector.router.answer import SSE_DONE
from connector.router.apikey import ApiKeyGate
from connector.router.backends import Backends, Role
from connector.router.config import RouterConfig, parse_args
from connector.router.discovery import Discovery
from connector.router.drain import RouterDrain, admin_routes
from connector.router.looplag import LoopLag
from connector.router.membership import membership_routes
from connector.router.metrics import RouterMetrics
from connector.router.relay import DEGRADED, serve_request
from connector.router.tracing import RequestTrace
from connector.router.upstream import TransportError, from_exception
from telemetry.schema import Outcome

logger = logging.getLogger(__name__)


class RouterState:
    """One router instance's state; lives on ``app.state.router``."""

    def __init__(self, config: RouterConfig, tracer: Any = None) -> None:
        self.config = config
        self.tracer = tracer  # None: tracing off
        self.backends = Backends(config)
        # P legs still running after D's answer went out (see attempt.Attempt.cleanup).
        self.background: set[asyncio.Task[Any]] = set()
        self.responses: Counter[int] = Counter()
        self.retries: Counter[str] = Counter()  # attempts retried, by the failed leg's role
        self.degraded = 0  # requests sent to D alone while no P was usable
        self.router_errors = 0  # requests answered 502 for an exception of the router's own
        self.unauthorized = 0  # requests answered 401: no or a wrong API key
        self.metrics = RouterMetrics(self)
        self.loop_lag = LoopLag()
        self.drain = RouterDrain()  # SIGTERM: refuse new requests, finish those in flight
        self.discovery = Discovery.of(config, self.backends)  # --members-file, else None

    async def start(self) -> None:
        self.loop_lag.start()
        await self.backends.start()
        if self.discovery is not None:
            await self.discovery.start()
        c = self.config
        logger.info(
            "router up: mode=%s prefill=%s decode=%s; API key %s; backend key %s; P coordinates %s",
            c.mode.value,
            list(c.prefill_urls),
            list(c.decode_urls),
            "required" if c.api_key else "NOT required (anyone reaching the port is served)",
            "set" if c.backend_api_key else "none",
            "signed" if c.auth_secret else "unsigned",
        )

    async def stop(self) -> None:
        tasks = list(self.background)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.discovery is not None:
            await self.discovery.stop()
        await self.backends.stop()
        await self.loop_lag.stop()

    def stats(self) -> dict[str, Any]:
        return {
            "mode": self.config.mode.value,
            "requests": {
                "total": sum(self.responses.values()),
                "by_status": {str(k): v for k, v in sorted(self.responses.items())},
                "retried": {"total": sum(self.retries.values()), **self.retries},
                "degraded": self.degraded,
                "router_errors": self.router_errors,
                "unauthorized": self.unauthorized,
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

    def __init__(self, send: Send, state: RouterState, trace: RequestTrace) -> None:
        self._send, self._state, self._trace = send, state, trace
        self.status: int | None = None
        self.complete = False
        self.disconnected = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self._state.responses[message["status"]] += 1
            message = {**message, "headers": self._stamped(message.get("headers", []))}
        elif message["type"] == "http.response.body" and (
            not message.get("more_body") or message.get("body", b"").endswith(SSE_DONE)
        ):
            # A client may hang up as soon as it has the stream's last event.
            self.complete = True
        await self._send(message)

    def _stamped(self, headers: Any) -> list[tuple[bytes, bytes]]:
        """Every answer names its trace; a whole (not streamed) one also carries the
        segments the router saw, for the client's own timing tools."""
        out = [*headers, (b"traceresponse", self._trace.traceresponse.encode())]
        streamed = any(k.lower() == b"content-type" and b"event-stream" in v for k, v in headers)
        if not streamed:
            timing = self._trace.server_timing(time.time_ns())
            out.append((b"server-timing", timing.encode()))
        return out

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
            metrics=state.metrics,
            loop_lag=state.loop_lag,
            arrival=arrival.arrival_of(scope),
        )
        exchange = _Exchange(send, state, trace)
        error: str | None = None
        try:
            with state.drain.request() as cut:
                error = await self._answer(scope, receive, request, trace, exchange)
            if cut.cancelled_caught:  # the router's drain deadline passed (serve.py)
                error = "drain_timeout"
                why = "router shut down before the answer was complete (--drain-timeout)"
                await self._router_error(scope, receive, exchange, why, "service_unavailable")
        except Exception as exc:
            # A race or bug of the router's own: a clear JSON error, never a bare 500.
            error = "router_error"
            state.router_errors += 1
            logger.exception("router: unexpected error serving a request")
            await self._router_error(scope, receive, exchange, _exc_message(exc), "router_error")
        except BaseException:
            error = Outcome.CANCELLED.value if exchange.disconnected else "router_error"
            raise
        finally:
            if exchange.disconnected:
                error = Outcome.CANCELLED.value  # the client left before the answer was complete
            try:
                trace.end(exchange.status, error)
                state.metrics.request_ended(
                    exchange.status,
                    error,
                    start_ns=trace.start_ns,
                    first_leg_ns=trace.first_leg_ns,
                    first_chunk_ns=trace.first_chunk_ns,
                    end_ns=time.time_ns(),
                    trace_id=trace.trace_id,
                )
            except Exception:  # telemetry must never break serving
                logger.exception("Ending the request's spans or metrics failed")

    @staticmethod
    async def _router_error(
        scope: Scope, receive: Receive, exchange: _Exchange, message: str, kind: str
    ) -> None:
        """The router's own failure as the client's answer: a JSON error (502, or 503 for
        ``service_unavailable``), or an error event ending a stream already started."""
        status = 503 if kind == "service_unavailable" else 502
        try:
            if exchange.status is None:
                await error_response(status, message, kind)(scope, receive, exchange.send)
            elif not exchange.complete:
                err = json.dumps({"error": {"message": message, "type": kind}})
                event = f"\n\ndata: {err}\n\ndata: [DONE]\n\n".encode()
                await exchange.send({"type": "http.response.body", "body": event})
        except Exception:  # the client is gone: nothing left to tell it
            logger.debug("router: could not send the error answer", exc_info=True)

    async def _answer(
        self,
        scope: Scope,
        receive: Receive,
        request: Request,
        trace: RequestTrace,
        exchange: _Exchange,
    ) -> str | None:
        """Serve one request; returns why it failed before any leg ran, if it did."""
        counted = exchange.send
        if self.state.drain.draining:
            why = "router draining (shutting down): send the request to another router"
            await error_response(503, why, "service_unavailable")(scope, receive, counted)
            return "draining"
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
        async with anyio.create_task_group() as tg:
            tg.start_soon(exchange.watch_disconnect, receive, tg.cancel_scope)
            try:
                return await serve_request(
                    self.state,
                    self.endpoint,
                    body,
                    request_id=request_id,
                    trace=trace,
                    authorization=self._forwarded_authorization(request),
                    send=counted,
                    unavailable=lambda reason: error_response(503, reason, "service_unavailable")(
                        scope, receive, counted
                    ),
                )
            finally:
                tg.cancel_scope.cancel()
        return None  # the client left

    def _forwarded_authorization(self, request: Request) -> str | None:
        """The client's header goes to the backends only while the router has no keys of
        its own: with ``--api-key`` it holds the router's key, and a backend key replaces it."""
        c = self.state.config
        return None if c.api_key or c.backend_api_key else request.headers.get("authorization")


def _exc_message(exc: Exception) -> str:
    leaf: BaseException = exc
    while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
        leaf = leaf.exceptions[0]  # the task group's wrapping says nothing
    return f"router error: {leaf!r}"


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
        b = state.backends
        if state.drain.draining:
            status = {"status": "draining", "in_flight": state.drain.in_flight}
            return JSONResponse(status, status_code=503)
        reason = b.unavailable_reason()
        body: dict[str, Any] = {
            "status": "ok",
            "mode": config.mode.value,
            "prefill_eligible": sum(x.load.eligible for x in b.prefill),
            "decode_eligible": sum(x.load.eligible for x in b.decode),
        }
        if reason is not None and config.degraded and b.pick(Role.DECODE) is not None:
            # Only P is missing: degraded mode serves every request through D alone.
            body.update(status="degraded", reason=f"{DEGRADED['reason']} ({reason})")
        elif reason is not None:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse(body)

    async def models(_request: Request) -> Response:
        d = state.backends.pick(Role.DECODE)
        if d is None:
            return error_response(503, "no healthy decode server", "service_unavailable")
        try:
            r = await d.http.request("GET", "/v1/models")
        except TransportError as exc:
            err = from_exception(exc, d, "/v1/models")
            body, ctype = err.http_body()
            return Response(body, status_code=err.status, media_type=ctype)
        return Response(
            r.content, status_code=r.status_code, media_type=r.content_type or "application/json"
        )

    async def stats(_request: Request) -> Response:
        return JSONResponse(state.stats())

    async def metrics(request: Request) -> Response:
        body, ctype = state.metrics.render(request.headers.get("accept", ""))
        return Response(body, media_type=ctype)

    def rejected() -> None:
        state.unauthorized += 1

    gate = (
        [Middleware(ApiKeyGate, key=config.api_key, on_reject=rejected)] if config.api_key else []
    )
    app = Starlette(
        middleware=gate,
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
            Route("/metrics", metrics, methods=["GET"]),
            *admin_routes(state.backends),
            *membership_routes(state.backends, config.drain_timeout_s),
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
    from connector.router.serve import serve  # imports uvicorn: the serving process only

    # The span exporter encodes in a thread of its own; at CPython's 5 ms GIL switch interval
    # the loop waits up to that long for the GIL each time it wakes meanwhile (loop lag p50
    # 7-10 ms against 1-4 ms at 0.5 ms with a busy thread: python -m bench.loop_gil).
    sys.setswitchinterval(0.0005)
    if config.realtime_priority:  # before any thread starts: they inherit the class
        why = priority.realtime(config.realtime_priority)
        if why:
            logger.warning("router: --realtime-priority not applied: %s", why)

    from telemetry.schema import Service
    from telemetry.setup import setup_tracing

    provider = setup_tracing(Service.ROUTER.value, role="router")
    tracer = provider.get_tracer("pushkv.router") if provider is not None else None
    app = create_app(config, tracer, on_shutdown=provider.shutdown if provider else None)
    serve(app, config, app.state.router.drain)
    return 0
