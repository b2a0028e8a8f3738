"""The router's generation endpoints (``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses``): one client request from its arrival to its answer.

Owns: ``ProxyEndpoint``, a raw ASGI app per endpoint (the drain gate, the client's body
parsed, the request's trace and metrics ended however it went, the router's own failure as
a clear JSON error), and ``_Exchange``, what it learns while it answers: the status sent,
the ids and timings every answer carries (``traceresponse``, ``Server-Timing``), and the
client-disconnect watch. Each request's attempts are ``relay.serve_request``'s.

Must not import: uvicorn; ``connector.router.app`` only for its types.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.types import Message, Receive, Scope, Send

from connector.router import arrival, legs
from connector.router.answer import SSE_DONE, error_response
from connector.router.apikey import forwarded_authorization
from connector.router.relay import serve_request
from connector.router.tracing import RequestTrace
from telemetry.schema import Outcome

if TYPE_CHECKING:
    from connector.router.app import RouterState

logger = logging.getLogger(__name__)


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
    """``POST /v1/completions``, ``/v1/chat/completions`` and ``/v1/responses`` (always
    D alone: ``legs.decode_alone_reason``), as a raw ASGI app: it must
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
                    authorization=forwarded_authorization(
                        self.state.config, request.headers.get("authorization")
                    ),
                    send=counted,
                    unavailable=lambda reason: error_response(503, reason, "service_unavailable")(
                        scope, receive, counted
                    ),
                )
            finally:
                tg.cancel_scope.cancel()
        return None  # the client left


def _exc_message(exc: Exception) -> str:
    leaf: BaseException = exc
    while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
        leaf = leaf.exceptions[0]  # the task group's wrapping says nothing
    return f"router error: {leaf!r}"
