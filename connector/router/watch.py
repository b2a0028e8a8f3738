"""D-side awaits that the P leg's failure interrupts (push modes: both legs run at once).

Owns: ``PrefillWatch`` and ``PREFILL_FAILED`` (what an interrupted await returns, the one
``PrefillFailed``).

Must not import: starlette, uvicorn, ``connector.router.app``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, Final, TypeVar

import anyio

from connector.router.upstream import UpstreamError

T = TypeVar("T")


class PrefillFailed:
    """Returned by ``PrefillWatch.run`` instead of a value when the P leg failed."""


PREFILL_FAILED: Final = PrefillFailed()


class PrefillWatch:
    """Runs D-side awaits that the P leg's failure interrupts. With no P task (pull), or
    once P's leg has ended, it just awaits: a cancel scope per streamed chunk is a large
    share of the router's CPU under load."""

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self.failure: UpstreamError | None = None
        self._scope: anyio.CancelScope | None = None
        self._armed = task is not None  # P's leg may still fail
        if task is not None:
            task.add_done_callback(self._on_done)

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        self._armed = False
        if task.cancelled():
            return  # we cancelled it: D failed or the client left; nothing to report
        exc = task.exception()  # also marks it retrieved
        if exc is None:
            return
        self.failure = (
            exc
            if isinstance(exc, UpstreamError)
            else UpstreamError(502, f"prefill leg failed: {exc!r}")
        )
        if self._scope is not None:
            self._scope.cancel()

    async def run(self, aw: Awaitable[T]) -> T | PrefillFailed:
        if self.failure is not None:
            if asyncio.iscoroutine(aw):
                aw.close()
            return PREFILL_FAILED
        if not self._armed:
            return await aw
        with anyio.CancelScope() as scope:
            self._scope = scope
            try:
                return await aw
            finally:
                self._scope = None
        return PREFILL_FAILED  # only reached when the scope caught our own cancel
