"""In what order one attempt's legs run: one small strategy per mode.

Owns: ``Concurrent`` (push, vllm-push: P's task and D's request start at the same moment;
D's answer is relayed while P is watched; P failing first closes D and answers P's error,
D failing cancels P, D finishing first leaves P to end in the background), ``Sequential``
(pull: P, then D with P's returned ``kv_transfer_params``), ``FirstTokenFromP`` (push with
``--first-token prefill``: P, whose token the client gets at once, then D continuing from
it; once that token is out, a failure is an error event), ``Degraded`` (no P usable: D
alone with the client's body as is) and ``strategy_for`` (which one an attempt runs).

Must not import: uvicorn, ``connector.router.app``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, Protocol

from starlette.types import Send

from connector.core.errors import RemoteProtocolError
from connector.kv_params import PARAMS_FIELD
from connector.router import first_token, legs
from connector.router.answer import send_body, start
from connector.router.attempt import Attempt
from connector.router.backends import Role
from connector.router.config import Mode
from connector.router.decode_relay import relay, relay_stream
from connector.router.legstate import LegEvent
from connector.router.tracing import TraceStamp
from connector.router.upstream import Stream, UpstreamError
from connector.router.watch import PrefillFailed, PrefillWatch


class Strategy(Protocol):
    async def serve(self, a: Attempt, send: Send) -> None:
        """Run the attempt's legs and answer the client through ``send`` (or leave
        ``a.retry`` set and send nothing). ``Attempt.cleanup`` runs after it either way."""


async def _decode_and_relay(
    a: Attempt, send: Send, decode: Awaitable[Stream], watch: PrefillWatch
) -> None:
    """Wait for D's answer to open (P's failure interrupts it), then relay it."""
    try:
        opened = await watch.run(decode)
    except UpstreamError as err:
        a.d_leg.on(LegEvent.FAILED, err.message)
        role = await a.blame_decode(err, answered=err.body is not None)
        if role is Role.DECODE:
            a.d.backend.record_leg_failure(suspect=err.suspect)
        a.cancel_prefill()
        return await a.fail_early(send, err, role)
    if isinstance(opened, PrefillFailed):
        assert watch.failure is not None
        return await a.prefill_failed(send, watch.failure, tail=None)
    await relay(a, send, opened, watch)


async def _prefill_first(a: Attempt, send: Send) -> dict[str, Any] | None:
    """P's leg before D's: its answer, or None once its failure has been answered (or
    left to the next attempt)."""
    assert a.p is not None
    try:
        return await a.prefill()
    except UpstreamError as err:
        await a.fail_early(send, err, Role.PREFILL)
        return None
    finally:
        a.p.release()


class Degraded:
    async def serve(self, a: Attempt, send: Send) -> None:
        await _decode_and_relay(a, send, a.open_decode(), PrefillWatch(None))


class Concurrent:
    async def serve(self, a: Attempt, send: Send) -> None:
        p = a.p
        assert p is not None
        # Both legs leave now. The P leg is a task so that D's relay can watch it. P's
        # prefill is the long pole (D only has to register before it ends), so its task
        # gets the loop first and sends its request before D's is built; under load the
        # task would otherwise queue behind D's send (a late prefill_leg in the traces).
        task = asyncio.create_task(a.prefill(), name=f"prefill-{a.transfer_id}")
        task.add_done_callback(lambda _t: p.release())
        a.p_leg.task = task
        watch = PrefillWatch(task)
        await asyncio.sleep(0)
        await _decode_and_relay(a, send, a.open_decode(), watch)


class Sequential:
    async def serve(self, a: Attempt, send: Send) -> None:
        assert a.p is not None
        answer = await _prefill_first(a, send)
        if answer is None:
            return
        p = a.p.backend
        params = answer.get(PARAMS_FIELD)
        if not isinstance(params, dict):
            p.record_leg_failure(suspect=True)
            no_params = UpstreamError(502, f"{p.name} returned no {PARAMS_FIELD}", backend=p.name)
            return await a.fail_early(send, no_params, Role.PREFILL)
        params = legs.apply_pull_overrides(params, p.override)
        await _decode_and_relay(a, send, a.open_decode(params), PrefillWatch(None))


class FirstTokenFromP:
    """P's blocks wait for D's registration as in either order of the push protocol."""

    async def serve(self, a: Attempt, send: Send) -> None:
        assert a.p is not None
        p = a.p.backend
        answer = await _prefill_first(a, send)
        if answer is None:
            return
        try:
            token = first_token.PrefillToken.read(answer)
        except RemoteProtocolError as exc:
            p.record_leg_failure(suspect=True)
            unusable = UpstreamError(502, f"{p.name}: {exc}", backend=p.name)
            return await a.fail_early(send, unusable, Role.PREFILL)
        stamp = TraceStamp(a.trace.trace_id)
        await send(start(200, "text/event-stream", a.request_id))
        if token.stopped:
            # No D leg: P's blocks wait for a registration until their lease ends (lease_s).
            events = stamp.feed(first_token.first_event(token))
            events += stamp.feed(first_token.final_events(token, a.body))
            a.trace.sent(events, stream=True)
            return await send_body(send, events)
        event = stamp.feed(first_token.first_event(token))
        await send({"type": "http.response.body", "body": event, "more_body": True})
        a.trace.sent(event, stream=True)
        try:
            resp = await a.open_decode(token=token)
        except UpstreamError as err:
            a.d_leg.on(LegEvent.FAILED, err.message)
            a.d.backend.record_leg_failure(suspect=err.suspect)
            return await send_body(send, err.sse())
        a.decode_opened(resp)
        await relay_stream(
            a,
            send,
            resp,
            PrefillWatch(None),
            started=True,
            rewrite=first_token.count_token_as_output,
        )


def strategy_for(a: Attempt) -> Strategy:
    if a.first_token_from_p:
        return FirstTokenFromP()
    if a.p is None:
        return Degraded()
    if a.config.mode is Mode.PULL:
        return Sequential()
    return Concurrent()
