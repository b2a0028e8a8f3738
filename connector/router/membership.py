"""Live membership: adding and removing P and D backends while the router serves.

Owns: ``membership_routes`` (behind the same ``ApiKeyGate`` as every route but ``/health``):

- ``POST /admin/backends/{role}`` with ``{"url": ..., "engine_id", "kv_host", "kv_port",
  "tp_size"}`` (the last four: a P's transfer coordinates, as the ``--prefill-*`` flags;
  required in vllm-push mode): the backend is checked (a push-mode P probed) once before
  the answer, and gets legs only once healthy, like one given at start-up. 201 with its
  state; ``in_rotation`` says whether it is already eligible (else the health loop keeps
  checking it every ``backends.RECHECK_S``).
- ``DELETE /admin/backends/{role}/{backend}[?timeout=S]``: drain (no new legs), wait up to
  S seconds (default ``--drain-timeout``) for its legs in flight, then forget it (200). Past
  S it stays draining and the answer is 409 with the legs still in flight; DELETE again.
  The last D is not removed (409): nothing could serve.

Must not import: uvicorn, ``connector.router.app`` / ``relay``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from connector.core.errors import ConfigError
from connector.router.backends import Backends, Role
from connector.router.config import Mode, check_url
from connector.router.coords import CoordOverride
from connector.router.drain import drain_and_wait

_COORDS = {"engine_id": str, "kv_host": str, "kv_port": int, "tp_size": int, "pp_size": int}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}},
        status_code=status,
    )


def _role(name: str) -> Role | None:
    try:
        return Role(name)
    except ValueError:
        return None


def parse_new_backend(raw: bytes, role: Role, mode: Mode) -> tuple[str, CoordOverride]:
    """The URL and coordinates of a backend to add; ``ValueError`` with the reason."""
    try:
        body = json.loads(raw or b"null")
    except ValueError:
        raise ValueError('the body must be JSON: {"url": "http://host:port"}') from None
    if not isinstance(body, dict) or not isinstance(body.get("url"), str):
        raise ValueError("the body must be a JSON object with a string 'url'")
    unknown = set(body) - {"url", *_COORDS}
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)}; known: url, {', '.join(_COORDS)}")
    for key, kind in _COORDS.items():
        v = body.get(key)
        if v is not None and (not isinstance(v, kind) or isinstance(v, bool)):
            raise ValueError(f"'{key}' must be {'an integer' if kind is int else 'a string'}")
    try:
        url = check_url(body["url"])
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    o = CoordOverride(
        body.get("engine_id"),
        body.get("kv_host"),
        body.get("kv_port"),
        body.get("tp_size"),
        body.get("pp_size"),
    )
    if role is Role.DECODE and not o.empty:
        raise ValueError("transfer coordinates are a prefill server's, not a decode server's")
    if mode is Mode.VLLM_PUSH and o.tp_size is None:
        o = replace(o, tp_size=1)  # as the --prefill-tp-size flag defaults in this mode
    if o.port is not None and not 0 < o.port < 65536:
        raise ValueError(f"kv_port out of range: {o.port}")
    for key in ("tp_size", "pp_size"):
        if (n := getattr(o, key)) is not None and n < 1:
            raise ValueError(f"{key} must be >= 1: {n}")
    if o.pp_size not in (None, 1) and mode is not Mode.PUSH:
        raise ValueError("pp_size above 1 needs --mode push (vLLM's legs carry no stages)")
    if role is Role.PREFILL and mode is Mode.VLLM_PUSH and not o.complete:
        raise ValueError("--mode vllm-push needs engine_id, kv_host and kv_port for a new P")
    return url, o


def membership_routes(backends: Backends, drain_timeout_s: float) -> list[Route]:
    async def add(request: Request) -> Response:
        role = _role(request.path_params["role"])
        if role is None:
            return _error(404, f"no role {request.path_params['role']!r} (prefill or decode)")
        try:
            url, override = parse_new_backend(await request.body(), role, backends.config.mode)
        except ValueError as exc:
            return _error(400, str(exc))
        if backends.find(role, url) is not None:
            return _error(409, f"{role.value} backend {url} is already a member")
        b = await backends.add(role, url, override)
        body: dict[str, Any] = {"role": role.value, "in_rotation": b.load.eligible, **b.stats()}
        return JSONResponse(body, status_code=201)

    async def remove(request: Request) -> Response:
        role = _role(request.path_params["role"])
        if role is None:
            return _error(404, f"no role {request.path_params['role']!r} (prefill or decode)")
        key = request.path_params["backend"]
        b = backends.find(role, key)
        if b is None:
            return _error(404, f"no {role.value} backend {key!r} (an index or a URL)")
        try:
            timeout = float(request.query_params.get("timeout", drain_timeout_s))
        except ValueError:
            return _error(400, "timeout must be a number of seconds")
        if role is Role.DECODE and len(backends.decode) == 1:
            return _error(409, f"{b.name} is the only decode server: add another first")
        if refused := await drain_and_wait(backends, b, timeout, "DELETE again to remove it"):
            return refused
        await backends.remove(b)
        return JSONResponse({"role": role.value, "removed": True, **b.stats()})

    return [
        Route("/admin/backends/{role}", add, methods=["POST"]),
        Route("/admin/backends/{role}/{backend:path}", remove, methods=["DELETE"]),
    ]
