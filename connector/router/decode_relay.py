"""Relaying D's answer to the client, whole or as a stream, while P's leg is watched.

Owns: ``relay`` (D's answer, as the client asked for it), ``relay_stream`` (also the
first-token mode's continuation), the rule for a stream that opens with an error event
(``stream_error``: P's failure when its P is gone, left to the next attempt) and the rule
for an answer vLLM aborted before its first token (a D shutting down: the next attempt).

Must not import: uvicorn, ``connector.router.app``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.types import Send

from connector.router.answer import SSE_DONE, send_body, start
from connector.router.attempt import Attempt, Retry
from connector.router.backends import Role
from connector.router.legstate import LegEvent
from connector.router.tracing import TraceStamp
from connector.router.upstream import Stream, TransportError, UpstreamError
from connector.router.watch import PrefillFailed, PrefillWatch


def _response_start(a: Attempt, resp: Stream) -> dict[str, Any]:
    return start(resp.status_code, resp.content_type or "application/json", a.request_id)


async def relay(a: Attempt, send: Send, resp: Stream, watch: PrefillWatch) -> None:
    """D's open answer to the client: streamed or whole, as the client asked."""
    a.decode_opened(resp)
    if a.stream:
        await relay_stream(a, send, resp, watch)
    else:
        await _relay_whole(a, send, resp, watch)


async def _relay_whole(a: Attempt, send: Send, resp: Stream, watch: PrefillWatch) -> None:
    try:
        body = await watch.run(resp.read())
    except TransportError as exc:
        return await a.decode_failed(send, exc, started=False)
    if isinstance(body, PrefillFailed):
        assert watch.failure is not None
        return await a.prefill_failed(send, watch.failure, tail=None)
    if _ABORT in body and _aborted_before_a_token(_payloads_whole(body)) and _retry_aborted(a):
        return
    a.trace.decode_bytes()
    a.d_leg.on(LegEvent.COMPLETED)
    if a.answer_id is not None and resp.status_code == 200:
        a.answer_id.whole(body)
    await send(_response_start(a, resp))
    await send({"type": "http.response.body", "body": body, "more_body": False})
    a.trace.sent(body, stream=False)


async def relay_stream(
    a: Attempt,
    send: Send,
    resp: Stream,
    watch: PrefillWatch,
    *,
    started: bool = False,
    rewrite: Callable[[bytes], bytes] | None = None,
) -> None:
    """The client's answer starts with D's first chunk, not D's headers: until then a
    failure of either leg is still a plain error answer, or another attempt. ``started``:
    it already has (P's token was sent). ``rewrite``: applied to whole events."""
    stamp = TraceStamp(a.trace.trace_id)
    tail = b"\n\n"

    async def forward(data: bytes) -> None:
        nonlocal started, tail
        if not data:
            return
        if rewrite is not None:
            data = rewrite(data)
        if not started:
            started = True
            await send(_response_start(a, resp))
        a.trace.decode_bytes()
        if a.answer_id is not None:
            a.answer_id.events(data)
        tail = (tail + data)[-len(SSE_DONE) :]
        await send({"type": "http.response.body", "body": data, "more_body": True})
        a.trace.sent(data, stream=True)
        if tail == SSE_DONE:
            a.d_leg.on(LegEvent.COMPLETED)  # the client has it all and may hang up now

    while True:
        try:
            chunk = await watch.run(resp.next_chunk())
        except TransportError as exc:
            await forward(stamp.flush())  # what D sent before it broke, as before
            return await a.decode_failed(send, exc, started=started, tail=tail)
        if isinstance(chunk, PrefillFailed):
            assert watch.failure is not None
            await forward(stamp.flush())
            return await a.prefill_failed(send, watch.failure, tail=tail if started else None)
        if chunk is None:
            break
        events = stamp.feed(chunk)
        if not started and (early := _stream_error(a, events)) is not None:
            if await _retry_stream_error(a, early):
                return
        if (
            not started
            and _ABORT in events
            and _aborted_before_a_token(_payloads_stream(events))
            and _retry_aborted(a)
        ):
            return
        await forward(events)
    await forward(stamp.flush())
    a.d_leg.on(LegEvent.COMPLETED)
    if not started:
        await send(_response_start(a, resp))
    await send_body(send, b"")


def _stream_error(a: Attempt, events: bytes) -> UpstreamError | None:
    """D's stream opening with an error event instead of a token: what vLLM streams when
    the request fails before its first token (a failed KV load under
    ``kv_load_failure_policy: fail``). Nothing has reached the client yet."""
    if not events.startswith(b'data: {"error"'):
        return None
    try:
        payload = json.loads(events[6 : events.index(b"\n\n")])
        status = int(payload["error"].get("code") or 500)
    except (ValueError, KeyError, TypeError, AttributeError):
        status = 500
    d = a.d.backend
    return UpstreamError(
        status if 500 <= status < 600 else 500,
        f"{d.name} streamed an error before its first token (decode transfer_id={a.transfer_id})",
        backend=d.name,
        suspect=True,
    )


async def _retry_stream_error(a: Attempt, err: UpstreamError) -> bool:
    """D's stream opened with an error event: True when it is left to the next attempt (P
    is to blame and one is allowed); else it goes to the client as D sent it."""
    if not a.may_retry or a.p is None:
        return False
    if await a.blame_decode(err, answered=True) is not Role.PREFILL:
        return False
    a.d_leg.on(LegEvent.FAILED, err.message)
    a.cancel_prefill()
    a.retry = Retry(Role.PREFILL, err)
    return True


# Only an answer naming this reason is parsed again (the relay passes D's bytes through).
_ABORT = b'"abort"'


def _payloads_whole(body: bytes) -> list[Any]:
    try:
        return [json.loads(body)]
    except ValueError:
        return []


def _payloads_stream(events: bytes) -> list[Any]:
    out: list[Any] = []
    for event in events.split(b"\n\n"):
        if event.startswith(b"data: {"):
            try:
                out.append(json.loads(event[6:]))
            except ValueError:
                return []  # a partial event: decide on a later chunk
    return out


def _aborted_before_a_token(payloads: list[Any]) -> bool:
    """vLLM's answer to a request it aborted before generating anything: every choice ends
    with ``finish_reason`` "abort" and no text (what a D answers a leg that reached it as
    it began shutting down). A request with any token is the client's, as is."""
    choices = [c for p in payloads if isinstance(p, dict) for c in p.get("choices") or ()]
    if not choices:
        return False
    for c in choices:
        if not isinstance(c, dict) or c.get("finish_reason") != "abort":
            return False
        message = c.get("message") or c.get("delta") or {}
        if c.get("text") or (isinstance(message, dict) and message.get("content")):
            return False
    return True


def _retry_aborted(a: Attempt) -> bool:
    """D aborted the request before its first token: True when another attempt will serve
    it (D is left out of it); else the client gets D's answer as it is."""
    if not a.may_retry:
        return False
    d = a.d.backend
    err = UpstreamError(
        503,
        f"{d.name} aborted the request before its first token (decode transfer_id="
        f"{a.transfer_id}): shutting down?",
        backend=d.name,
    )
    a.d_leg.on(LegEvent.FAILED, err.message)
    d.record_leg_failure(suspect=True)
    a.cancel_prefill()
    a.retry = Retry(Role.DECODE, err)
    return True
