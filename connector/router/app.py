"""The router's ASGI app (Starlette) and its ``main``.

Owns: ``RouterState`` (everything one app instance holds: backends, in-flight background
tasks, counters; no module globals), ``create_app(config)`` with its lifespan and routes,
the router's own read-only endpoints (``/health``, ``/router/stats``, ``/metrics``), and
``main(argv)`` (``serve.py``: uvicorn, the drain on SIGTERM). The generation endpoints
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``) are ``proxy.py``'s;
vLLM's others (``/v1/models``, ``/tokenize``...) and the 404 for the rest,
``passthrough.py``'s; ``/admin/``: ``drain.py``, ``membership.py``.

Must not import: vLLM, NIXL, torch (the router runs in its own process, next to neither).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from connector.router import legs, priority
from connector.router.apikey import ApiKeyGate
from connector.router.backends import Backends, Role
from connector.router.config import RouterConfig, parse_args
from connector.router.discovery import Discovery
from connector.router.drain import RouterDrain, admin_routes
from connector.router.looplag import LoopLag
from connector.router.membership import membership_routes
from connector.router.metrics import RouterMetrics
from connector.router.passthrough import not_served, passthrough_routes
from connector.router.proxy import ProxyEndpoint
from connector.router.relay import DEGRADED
from connector.router.response_homes import ResponseHomes

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
        self.response_homes = ResponseHomes()  # /v1/responses: which D stores each answer
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
            "stored_responses": self.response_homes.stats(),
            **self.backends.stats(),
        }


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
            Route("/v1/responses", ProxyEndpoint(state, legs.Endpoint.RESPONSES), methods=["POST"]),
            *passthrough_routes(state),
            Route("/health", health, methods=["GET"]),
            Route("/router/stats", stats, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            *admin_routes(state.backends),
            *membership_routes(state.backends, config.drain_timeout_s),
        ],
        exception_handlers={404: not_served},
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
