"""One client request through P and D: its attempts, each served by its mode's strategy.

Owns: ``serve_request`` (up to ``max_attempts`` attempts while every failure came before
the client's first byte; a degraded attempt, D alone, while no P is usable), ``route``
(P and D for the next attempt) and ``serve_attempt`` (one attempt: its strategy, then
both legs closed). The caller (``app.py``) runs ``serve_request`` under a cancel scope
that fires when the client disconnects; cleanup then closes both legs.

Reading order: ``legstate.py`` (a leg's states), ``attempt.py`` (one attempt's legs and
failure rules), ``modes.py`` (the order of the legs per mode), ``decode_relay.py`` (D's
answer to the client), ``watch.py`` (P's failure interrupting D's awaits).

Must not import: uvicorn, ``connector.router.app``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol

from starlette.types import Send

from connector.router import affinity, legs
from connector.router.answer import send_error, send_json_error
from connector.router.attempt import Attempt, Retry
from connector.router.backends import Backend, Backends, Lease, Role
from connector.router.chooser import Choice, Policy
from connector.router.config import FirstToken, RouterConfig
from connector.router.modes import strategy_for
from connector.router.response_homes import (
    HomeUnavailable,
    ResponseHomes,
    ResponseIdReader,
    locate,
    previous_response_id,
)
from connector.router.tracing import RequestTrace

logger = logging.getLogger(__name__)
DEGRADED: Final = {"reason": "degraded: no prefill server usable, D computes the prompt"}


class Router(Protocol):
    """What a request needs of the router's state (``app.RouterState``)."""

    config: RouterConfig
    backends: Backends
    background: set[asyncio.Task[Any]]  # P legs still running after D's answer went out
    retries: Counter[str]
    degraded: int
    response_homes: ResponseHomes  # /v1/responses: which D stores each answer


async def serve_attempt(a: Attempt, send: Send) -> None:
    """Answer the client through ``send`` (or leave ``a.retry``); always leaves both legs
    closed or (P only, after D finished) running to its own deadline."""
    logger.debug(
        "router dispatch request_id=%s transfer_id=%s P=%s D=%s",
        a.request_id,
        a.transfer_id,
        a.p.backend.name if a.p is not None else "none (degraded)",
        a.d.backend.name,
    )
    if a.config.first_token is FirstToken.PREFILL:
        a.trace.first_token("prefill" if a.first_token_from_p else "decode", a.first_token_blocker)
    try:
        await strategy_for(a).serve(a, send)
    finally:
        a.cleanup()


def prefix_of(config: RouterConfig, body: dict[str, Any]) -> tuple[int, ...]:
    """The prompt's block hashes when the policy routes on them (else nothing to hash)."""
    if config.policy is not Policy.PREFIX:
        return ()
    text = affinity.prefix_text(body)
    return affinity.block_hashes(text, config.prefix_block_chars) if text else ()


def route(
    router: Router,
    failed: dict[Role, set[int]],
    prefix: tuple[int, ...] = (),
    *,
    decode_alone: bool = False,
) -> tuple[Lease | None, Lease | None]:
    """P and D for the next attempt, avoiding the backends this request failed on. P is
    None with D set for a degraded attempt: no P usable (none healthy, or the only ones
    failed this request before its first byte), degraded mode on: losing a P mid-flight
    costs the request a local prefill on D, not an error. ``prefix``: ``prefix_of``;
    ``decode_alone``: the request goes to D whole (``legs.decode_alone_reason``)."""
    backends = router.backends
    p = None
    if not decode_alone:
        p = backends.acquire(Role.PREFILL, frozenset(failed[Role.PREFILL]), prefix)
        if p is None and not router.config.degraded:
            return None, None
    d = backends.acquire(Role.DECODE, frozenset(failed[Role.DECODE]), prefix)
    if d is None and p is not None:
        p.release()
        p = None
    return p, d


async def serve_request(
    router: Router,
    endpoint: legs.Endpoint,
    body: dict[str, Any],
    *,
    request_id: str,
    trace: RequestTrace,
    authorization: str | None,
    send: Send,
    unavailable: Callable[[str], Awaitable[None]],
) -> str | None:
    """Up to ``max_attempts`` attempts, each with a fresh transfer_id, while every leg
    failure so far came before the client's first byte. ``unavailable(reason)`` answers
    503 when no backend can serve. A Responses API request continuing a stored response
    goes to the D that stores it (``response_homes.locate``), and no other: one attempt.
    Returns why the request failed, if it did."""
    max_attempts = router.config.max_attempts
    failed: dict[Role, set[int]] = {Role.PREFILL: set(), Role.DECODE: set()}
    last: Retry | None = None
    prefix = prefix_of(router.config, body)
    alone = legs.decode_alone_reason(body, endpoint)
    home: Backend | None = None
    if endpoint is legs.Endpoint.RESPONSES and (prev := previous_response_id(body)) is not None:
        route_start = time.time_ns()
        try:
            home = await locate(router.backends, router.response_homes, prev, authorization)
        except HomeUnavailable as exc:
            trace.routed(route_start, None, None, None, error=exc.message)
            trace.attempted(0, degraded=False)
            kind = "not_found" if exc.status == 404 else "service_unavailable"
            await send_json_error(send, exc.status, exc.message, kind, request_id)
            return exc.message
        if home is not None:
            max_attempts = 1
            home_why = f"previous_response_id {prev!r} is stored on this D only"
    for attempt in range(1, max_attempts + 1):
        route_start = time.time_ns()
        p: Lease | None
        d: Lease | None
        if home is not None:
            p, d = None, Lease(home, Choice(home.load, home_why))  # the request named it
        else:
            p, d = route(router, failed, prefix, decode_alone=alone is not None)
        if d is None:
            trace.routed(route_start, None, None, None, error="no_backend")
            trace.attempted(attempt - 1, degraded=False)
            if last is not None:  # nothing left to retry on: the last failure answers
                await send_error(send, last.error, request_id)
                return last.error.message
            await unavailable(router.backends.unavailable_reason() or "no healthy backend")
            return "no_backend"
        d_why = d.choice.reason if d.choice else ""
        if alone is not None:
            d_why = f"D alone: {alone}; {d_why}"
        elif p is None:
            router.degraded += 1
            d_why = f"{DEGRADED['reason']}; {d_why}"
        trace.routed(
            route_start,
            p.backend.url if p is not None else None,
            d.backend.url,
            d.backend.load.outstanding,
            reason=d_why,
            policy=router.config.policy.value,
            prefill_reason=p.choice.reason if p is not None and p.choice else None,
            prefix_blocks=d.choice.prefix_blocks if d.choice else None,
        )
        trace.attempted(attempt, degraded=p is None and alone is None)
        a = Attempt(
            router.config,
            endpoint,
            body,
            p,
            d,
            request_id=request_id,
            trace=trace,
            authorization=authorization,
            background=router.background,
            may_retry=attempt < max_attempts,
            answer_id=_answer_id_reader(router.response_homes, d.backend)
            if endpoint is legs.Endpoint.RESPONSES
            else None,
        )
        await serve_attempt(a, send)
        if a.retry is None:
            return None
        last = a.retry
        await a.settled()
        leg = a.p if last.role is Role.PREFILL else a.d
        assert leg is not None
        failed[last.role].add(leg.backend.index)
        router.retries[last.role.value] += 1
        trace.attempt_failed(attempt, last.role.value, last.error.message)
        logger.warning(
            "router request_id=%s attempt %d failed before its first byte (%s leg): %s",
            request_id,
            attempt,
            last.role.value,
            last.error.message,
        )
    raise AssertionError("the last attempt answers the client")  # may_retry was False


def _answer_id_reader(homes: ResponseHomes, d: Backend) -> ResponseIdReader:
    """Remembers ``d`` as the home of the response it answers, once its id is seen."""
    return ResponseIdReader(lambda response_id: homes.remember(response_id, d.url))
