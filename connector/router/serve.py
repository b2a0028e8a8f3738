"""Serving the router with uvicorn, and its drain on SIGTERM.

Owns: ``RouterServer``, a ``uvicorn.Server`` whose first SIGTERM drains before uvicorn's own
graceful shutdown runs: the router keeps listening but refuses new requests (503, and
``/health`` answers 503 ``"draining"`` so a load balancer takes it out), waits until no
client request is in flight or ``--drain-timeout`` has passed, then hands over to uvicorn,
which stops accepting, closes idle connections, cancels what is still running once the rest
of the deadline is spent (its ``timeout_graceful_shutdown``), runs the lifespan's shutdown
and re-raises the signal. A second SIGTERM, or SIGINT, is uvicorn's own handling (SIGINT
twice: exit at once). Also ``serve(app, config)``.

Imported only by the serving process (``app.main``): it imports uvicorn.
Must not import: ``connector.router.relay``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

from connector.router import arrival
from connector.router.config import RouterConfig
from connector.router.drain import RouterDrain

logger = logging.getLogger(__name__)

# After the deadline: how long the requests cut get to write their error answer.
CUT_S = 1.0


class RouterServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: RouterDrain, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.drain, self.drain_timeout_s = drain, drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: runs on the loop's thread between two bytecodes, so it only
        # schedules the drain; the loop runs it.
        if sig == signal.SIGTERM and not self.drain.draining and self._loop is not None:
            self.drain.begin()
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.create_task(self._drain(), name="pushkv-router-drain")

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        logger.warning(
            "router: SIGTERM: draining, refusing new requests; %d in flight, waiting up to %.1f s",
            self.drain.in_flight,
            self.drain_timeout_s,
        )
        if await self.drain.wait_idle(self.drain_timeout_s):
            logger.info("router: drained: no request in flight; shutting down")
        else:
            logger.warning(
                "router: --drain-timeout (%.1f s) passed with %d request(s) in flight; "
                "cutting them (503, or an error event ending a stream)",
                self.drain_timeout_s,
                self.drain.in_flight,
            )
            self.drain.cut()
            await self.drain.wait_idle(CUT_S)
        # What is left of the deadline bounds uvicorn's own wait for connections.
        # At least 1 s, so an answer completing right now is still written out.
        self.config.timeout_graceful_shutdown = max(1, round(deadline - loop.time()))
        super().handle_exit(signal.SIGTERM, None)


def serve(app: Any, config: RouterConfig, drain: RouterDrain) -> None:
    """Run ``app`` until SIGTERM (drained, see above) or SIGINT."""
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        access_log=False,
        log_level=config.log_level,
        lifespan="on",
        http=arrival.protocol(),
        # SIGINT's graceful shutdown (no drain phase) is bounded by the same deadline.
        timeout_graceful_shutdown=max(1, round(config.drain_timeout_s)),
    )
    RouterServer(uv_config, drain, config.drain_timeout_s).run()
