"""vLLM's endpoints that generate nothing, through the router: forwarded to a D, or a 404
that names what the router serves.

Owns: ``passthrough_routes`` (``/v1/models``, ``/version``, ``/tokenize``, ``/detokenize``:
one D's answer as it is; a stored response, ``/v1/responses/{id}`` and its ``/cancel``:
the D that answered it, as vLLM keeps it in the memory of that server; an id the router
does not know (``response_homes``), each D in turn until one knows it) and ``not_served``
(the app's 404 handler: any other path). The generation endpoints are ``proxy.py``'s.

Must not import: uvicorn; ``connector.router.app`` only for its types.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from connector.router.answer import error_response
from connector.router.apikey import forwarded_authorization
from connector.router.backends import Backend, Role
from connector.router.upstream import Reply, TransportError, from_exception

if TYPE_CHECKING:
    from connector.router.app import RouterState

# (method, path): what the router answers itself or relays; ``not_served`` lists them.
GENERATION: Final = (
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"),
)
TO_ONE_D: Final = (
    ("GET", "/v1/models"),
    ("GET", "/version"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
)
TO_EACH_D: Final = (
    ("GET", "/v1/responses/{response_id}"),
    ("POST", "/v1/responses/{response_id}/cancel"),
)
ROUTER_OWN: Final = (("GET", "/health"), ("GET", "/router/stats"), ("GET", "/metrics"))


def passthrough_routes(state: RouterState) -> list[Route]:
    one = [Route(path, _endpoint(state, _to_one_d), methods=[m]) for m, path in TO_ONE_D]
    each = [Route(path, _endpoint(state, _to_home), methods=[m]) for m, path in TO_EACH_D]
    return [*one, *each]


async def not_served(request: Request, _exc: Exception) -> Response:
    """Starlette's 404 (no route matches the path): a JSON error in OpenAI's shape naming
    the endpoints the router serves, so a client sees at once what it can send here."""
    served = ", ".join(f"{m} {p}" for m, p in (*GENERATION, *TO_ONE_D, *TO_EACH_D, *ROUTER_OWN))
    why = f"the P/D router does not serve {request.method} {request.url.path}; it serves {served}"
    return error_response(404, why, "not_found")


Forward = Callable[
    ["RouterState", str, str, Any, "dict[str, str] | None", Mapping[str, str]],
    Awaitable[Response],
]


def _endpoint(state: RouterState, forward: Forward) -> Callable[[Request], Awaitable[Response]]:
    """One request forwarded whole: the client's query string, JSON body and (while the
    router has no keys of its own) ``Authorization``; the backend's answer as it is."""

    async def endpoint(request: Request) -> Response:
        body: Any = None
        if raw := await request.body():  # vLLM's cancel takes none
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                why = f"body is not valid JSON: {exc}"
                return error_response(400, why, "invalid_request_error")
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        auth = forwarded_authorization(state.config, request.headers.get("authorization"))
        headers = {"Authorization": auth} if auth else None
        return await forward(state, request.method, path, body, headers, request.path_params)

    return endpoint


async def _send(
    d: Backend, method: str, path: str, body: Any, headers: dict[str, str] | None
) -> Reply | Response:
    """D's reply, or the client's error answer when D could not be reached."""
    try:
        return await d.http.request(method, path, body=body, headers=headers)
    except TransportError as exc:
        err = from_exception(exc, d, path)
        content, ctype = err.http_body()
        return Response(content, status_code=err.status, media_type=ctype)


def _relayed(r: Reply) -> Response:
    return Response(r.content, r.status_code, media_type=r.content_type or "application/json")


async def _to_one_d(
    state: RouterState,
    method: str,
    path: str,
    body: Any,
    headers: dict[str, str] | None,
    _params: Mapping[str, str],
) -> Response:
    d = state.backends.pick(Role.DECODE)
    if d is None:
        return error_response(503, "no healthy decode server", "service_unavailable")
    r = await _send(d, method, path, body, headers)
    return _relayed(r) if isinstance(r, Reply) else r


async def _to_home(
    state: RouterState,
    method: str,
    path: str,
    body: Any,
    headers: dict[str, str] | None,
    params: Mapping[str, str],
) -> Response:
    """The D that answered the response (while it is a member: its own answer, an error
    if it is unreachable), else each D in turn; the one that knows it is remembered."""
    response_id = params["response_id"]
    url = state.response_homes.home(response_id)
    if url is not None and (home := state.backends.find(Role.DECODE, url)) is not None:
        r = await _send(home, method, path, body, headers)
        return _relayed(r) if isinstance(r, Reply) else r
    last: Response | None = None
    for d in state.backends.pool(Role.DECODE):
        r = await _send(d, method, path, body, headers)
        if isinstance(r, Reply) and r.status_code != 404:
            if r.status_code == 200:
                state.response_homes.remember(response_id, d.url)
            return _relayed(r)
        last = _relayed(r) if isinstance(r, Reply) else (last or r)
    if last is None:
        return error_response(503, "no decode server", "service_unavailable")
    return last  # no D knows it: a D's own 404 (else why the last one was unreachable)
