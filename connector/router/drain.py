"""Taking things out of rotation: one backend (the admin endpoints) or the whole router.

Owns: ``RouterDrain`` (the router's own drain: whether it still takes requests, and how many
client requests are in flight, so a shutdown can wait for them) and ``admin_routes``:

- ``GET /admin/backends``: every backend's health, ``draining`` and ``outstanding`` legs.
- ``POST /admin/backends/{role}/{backend}/drain`` and ``.../undrain``: ``role`` is
  ``prefill`` or ``decode``, ``backend`` its index or its URL (percent-encoded). A draining
  backend gets no new legs; its legs in flight run on (``policy.BackendLoad.draining``).
  ``drain?wait=S`` answers only once its last leg ended (409 if S seconds passed first):
  one call for a rolling restart's step, or a Kubernetes preStop hook.

The admin routes sit behind the same ``ApiKeyGate`` as every other route but ``/health``
(``app.py``). SIGTERM's handling, which uses ``RouterDrain``, is ``serve.py``'s.

Must not import: uvicorn, ``connector.router.app`` / ``relay``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from connector.router.backends import Backend, Backends, Role


class RouterDrain:
    """The router's own state as a server: serving, or draining (refusing new requests
    while those in flight finish). ``in_flight`` counts client requests being answered;
    ``cut`` ends them all (the drain's deadline passed)."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._scopes: set[anyio.CancelScope] = set()

    @contextlib.contextmanager
    def request(self) -> Iterator[anyio.CancelScope]:
        """Count one client request for as long as it is being answered. The scope is
        cancelled by ``cut``: ``cancelled_caught`` then says the request was cut."""
        self.in_flight += 1
        self._idle.clear()
        try:
            with anyio.CancelScope() as scope:
                self._scopes.add(scope)
                yield scope
        finally:
            self._scopes.discard(scope)
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    def cut(self) -> None:
        """Cancel every request in flight; each answers its client why (``app.py``)."""
        for scope in self._scopes:
            scope.cancel()

    def begin(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no client request is in flight; False if ``timeout_s`` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}},
        status_code=status,
    )


async def drain_and_wait(
    backends: Backends, b: Backend, wait_s: float, again: str
) -> JSONResponse | None:
    """Take ``b`` out of rotation and wait up to ``wait_s`` for its last leg to end: None
    once it has, else the 409 saying how many are left (``again``: what to do next)."""
    backends.set_draining(b, True)
    if await b.wait_idle(max(0.0, wait_s)):
        return None
    return _error(
        409,
        f"{b.name}: {b.load.outstanding} leg(s) still in flight after {wait_s:g} s; "
        f"it stays draining (no new legs): {again}",
    )


def admin_routes(backends: Backends) -> list[Route]:
    async def listing(_request: Request) -> Response:
        return JSONResponse(backends.stats())

    async def change(request: Request) -> Response:
        action = request.path_params["action"]
        if action not in ("drain", "undrain"):
            return _error(404, f"no action {action!r} (drain or undrain)")
        role_name = request.path_params["role"]
        try:
            role = Role(role_name)
        except ValueError:
            return _error(404, f"no role {role_name!r} (prefill or decode)")
        key = request.path_params["backend"]
        b = backends.find(role, key)
        if b is None:
            return _error(404, f"no {role.value} backend {key!r} (an index or a URL)")
        wait = request.query_params.get("wait")
        try:
            wait_s = None if wait is None or action != "drain" else float(wait)
        except ValueError:
            return _error(400, f"wait must be a number of seconds, got {wait!r}")
        if wait_s is None:
            backends.set_draining(b, action == "drain")
        elif refused := await drain_and_wait(
            backends, b, wait_s, "drain?wait again, or check GET /admin/backends"
        ):
            return refused
        body: dict[str, Any] = {"role": role.value, **b.stats()}
        return JSONResponse(body)

    return [
        Route("/admin/backends", listing, methods=["GET"]),
        Route(
            "/admin/backends/{role}/{backend:path}/{action:str}",
            change,
            methods=["POST"],
        ),
    ]
