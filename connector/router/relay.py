"""One routed request: its two legs, their failure and cancellation rules, and relaying D's
answer to the client as raw ASGI messages.

Over 400 lines, one job: both legs' failure and cancellation rules must be read together.

Owns: ``UpstreamError`` (a failed leg and the answer it becomes), ``Retry`` (an attempt that
failed before the client's first byte), ``PrefillWatch`` (cancels the D operation in progress
when the P leg fails) and ``Dispatch`` (one attempt):
- push / vllm-push: P's task and D's request start at the same moment; D's answer is relayed
  while P is watched. P failing first cancels D (closing its connection: vLLM aborts the
  request) and answers P's error; D failing cancels P. D finishing first leaves P to end in
  the background (its own deadline bounds it).
- pull: P, then D with P's returned ``kv_transfer_params``.
- push with ``--first-token prefill`` (``first_token.py``): P, whose token the client gets at
  once, then D continuing from it. Once that token is out, a failure is an error event.
- degraded (no P usable): D alone, with the client's body as is.
The caller (``app.py``) runs ``Dispatch.serve`` under a cancel scope that fires when the
client disconnects; cleanup then closes both legs.

Must not import: uvicorn, ``connector.router.app``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import anyio
from starlette.types import Send

from connector.core.errors import PushkvError, RemoteProtocolError
from connector.kv_params import PARAMS_FIELD, DecodeLeg, sign_decode_leg
from connector.router import first_token, legs
from connector.router.backends import Backend, Lease, Role
from connector.router.config import FirstToken, Mode, RouterConfig
from connector.router.tracing import RequestTrace
from connector.router.upstream import Stream, TransportError
from telemetry.schema import Outcome

logger = logging.getLogger(__name__)
T = TypeVar("T")
SSE_DONE: Final = b"data: [DONE]\n\n"  # the last event of an OpenAI stream


class UpstreamError(PushkvError):
    """A leg failed. ``body`` is the backend's own error body when it answered an error
    status (passed through as is); otherwise the router writes an OpenAI-style error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        backend: str | None = None,
        body: bytes | None = None,
        content_type: str | None = None,
        suspect: bool = True,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.backend = status, message, backend
        self.body, self.content_type, self.suspect = body, content_type, suspect

    def error_json(self) -> dict[str, Any]:
        kind = {502: "upstream_error", 503: "service_unavailable", 504: "upstream_timeout"}
        return {
            "error": {
                "message": self.message,
                "type": kind.get(self.status, "upstream_error"),
                "code": self.status,
                "backend": self.backend,
            }
        }

    def http_body(self) -> tuple[bytes, str]:
        if self.body is not None:
            return self.body, self.content_type or "application/json"
        return json.dumps(self.error_json()).encode(), "application/json"

    def sse(self) -> bytes:
        """How a stream that already started ends when a leg fails."""
        return b"data: " + json.dumps(self.error_json()).encode() + b"\n\ndata: [DONE]\n\n"


def from_exception(exc: BaseException, backend: Backend, what: str) -> UpstreamError:
    """Map a transport failure to the answer the client gets: timeout 504, else 502."""
    kind = exc.kind if isinstance(exc, TransportError) else None
    if kind == "connect":
        return UpstreamError(
            502, f"cannot connect to {backend.name} ({what}): {exc}", backend=backend.name
        )
    if kind == "timeout" or isinstance(exc, TimeoutError):
        return UpstreamError(504, f"{backend.name} timed out ({what})", backend=backend.name)
    return UpstreamError(502, f"{backend.name} failed ({what}): {exc}", backend=backend.name)


def _from_status(
    status: int, content_type: str | None, body: bytes, backend: Backend, what: str
) -> UpstreamError:
    return UpstreamError(
        status,
        f"{backend.name} answered {status} ({what})",
        backend=backend.name,
        body=body,
        content_type=content_type,
        suspect=status >= 500,
    )


async def post_json(
    backend: Backend,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    deadline_s: float,
    what: str,
) -> dict[str, Any]:
    """One non-streamed leg with a whole-leg deadline; returns the JSON answer."""
    try:
        try:
            async with asyncio.timeout(deadline_s):
                resp = await backend.http.request("POST", path, body=body, headers=headers)
        except (TransportError, TimeoutError) as exc:
            raise from_exception(exc, backend, what) from exc
        if resp.status_code >= 400:
            raise _from_status(resp.status_code, resp.content_type, resp.content, backend, what)
        try:
            answer = resp.json()
        except ValueError:
            raise UpstreamError(
                502, f"{backend.name} sent invalid JSON ({what})", backend=backend.name
            ) from None
        if not isinstance(answer, dict):
            raise UpstreamError(
                502, f"{backend.name} sent a non-object ({what})", backend=backend.name
            )
        return answer
    except UpstreamError as err:
        backend.record_leg_failure(suspect=err.suspect)
        logger.warning("router %s leg failed: %s", what, err.message)
        raise


async def open_stream(
    backend: Backend,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    what: str,
    *,
    record: bool = True,
) -> Stream:
    """Send a leg and return once its status and headers are in (body not read yet). An
    error status is read whole and raised as ``UpstreamError`` (passed through).
    ``record``: count the failure against ``backend`` here (else the caller decides whose
    failure it is: ``Dispatch.blame_decode``)."""
    try:
        resp = await backend.http.open(path, body, headers)
    except TransportError as exc:
        err = from_exception(exc, backend, what)
    else:
        if resp.status_code < 400:
            return resp
        try:
            raw = await resp.read()
            err = _from_status(resp.status_code, resp.content_type, raw, backend, what)
        except TransportError as exc:
            err = from_exception(exc, backend, what)
        finally:
            resp.close()
    if record:
        backend.record_leg_failure(suspect=err.suspect)
    logger.warning("router %s leg failed: %s", what, err.message)
    raise err


@dataclass(frozen=True)
class Retry:
    """Why an attempt ended without answering: a leg of ``role`` failed before the client
    got a byte, and another attempt is allowed."""

    role: Role
    error: UpstreamError


class _PrefillFailed:
    """Returned by ``PrefillWatch.run`` instead of a value when the P leg failed."""


PREFILL_FAILED: Final = _PrefillFailed()


class PrefillWatch:
    """Runs D-side awaits that the P leg's failure interrupts. With no P task (pull), or
    once P's leg has ended, it just awaits: a cancel scope per streamed chunk was ~30 % of
    the router's CPU under load."""

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

    async def run(self, aw: Awaitable[T]) -> T | _PrefillFailed:
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


class Dispatch:
    """One attempt at a client request: routed to one P and one D, or (degraded, ``p`` None)
    to D alone with the client's body as is, so D computes the prompt itself. With
    ``may_retry``, a leg failing before the client got a byte (connect error, timeout, 5xx)
    leaves ``retry`` set and nothing sent; the caller runs the next attempt."""

    def __init__(
        self,
        config: RouterConfig,
        endpoint: legs.Endpoint,
        body: dict[str, Any],
        p: Lease | None,
        d: Lease,
        *,
        request_id: str,
        trace: RequestTrace,
        authorization: str | None,
        background: set[asyncio.Task[Any]],
        may_retry: bool = False,
    ) -> None:
        self.config, self.endpoint, self.body = config, endpoint, body
        self.p, self.d = p, d
        # Read once: a health check may drop P's coordinates while this request runs.
        self.coords = p.backend.coords if p is not None else None
        self._may_retry = may_retry
        self.retry: Retry | None = None
        self.request_id, self.trace, self._authorization = request_id, trace, authorization
        self.stream = bool(body.get("stream", False))
        mode = config.mode
        self.transfer_id = (
            legs.vllm_transfer_id() if mode is Mode.VLLM_PUSH else legs.new_transfer_id()
        )
        self._background = background
        # First token from P: asked for, and this request allows it (else why not).
        self.first_token_blocker: str | None = None
        self.first_token = False
        if config.first_token is FirstToken.PREFILL and p is not None:
            self.first_token_blocker = first_token.blocker(endpoint, body)
            self.first_token = self.first_token_blocker is None
        self._p_task: asyncio.Task[dict[str, Any]] | None = None
        self._d_resp: Stream | None = None
        self._d_done = False  # D's whole answer has been relayed
        self._d_error: str | None = None  # why the D leg failed (its span's reason)

    # -- the two legs ------------------------------------------------------------------

    async def _prefill(self) -> dict[str, Any]:
        error: str | None = Outcome.CANCELLED.value
        try:
            answer = await self._prefill_leg()
            error = None
            return answer
        except UpstreamError as err:
            error = err.message
            raise
        finally:
            self.trace.prefill_ended(error)

    async def _prefill_leg(self) -> dict[str, Any]:
        assert self.p is not None  # no P leg in a degraded attempt
        p = self.p.backend
        traceparent = self.trace.prefill_started(p.url)
        body = legs.prefill_body(
            self.config.mode,
            self.endpoint,
            self.body,
            transfer_id=self.transfer_id,
            traceparent=traceparent,
            token_ids=self.first_token,
        )
        headers = legs.leg_headers(self.request_id, traceparent, self._authorization)
        answer = await post_json(
            p,
            self.endpoint.path,
            body,
            headers,
            self.config.timeout_s,
            f"prefill transfer_id={self.transfer_id}",
        )
        refused = legs.refusal(answer) if self.config.mode is Mode.PUSH else None
        if refused is not None:
            # pushkv's P computed the prompt but refused the transfer: D would wait for KV
            # that never comes. Fail the request now.
            p.record_leg_failure(suspect=False)
            raise UpstreamError(
                502, f"{p.name} refused transfer {self.transfer_id}: {refused}", backend=p.name
            )
        return answer

    def _decode(
        self,
        prefill_params: dict[str, Any] | None = None,
        token: first_token.PrefillToken | None = None,
    ) -> Awaitable[Stream]:
        """D's leg; ``token``: continued from P's token (first token from P)."""
        d = self.d.backend
        traceparent = self.trace.decode_started(d.url)
        if self.p is None:
            body = self.body  # degraded: D serves the whole request
        else:
            body = legs.decode_body(
                self.config.mode,
                self.body if token is None else first_token.continuation_body(self.body, token),
                transfer_id=self.transfer_id,
                traceparent=traceparent,
                request_id=self.request_id,
                coords=self.coords,
                prefill_params=prefill_params,
                remote_num_tokens=None if token is None else len(token.prompt_ids),
                sign=self._sign if self.config.auth_secret is not None else None,
            )
        headers = legs.leg_headers(self.request_id, traceparent, self._authorization)
        return open_stream(
            d,
            self.endpoint.path,
            body,
            headers,
            f"decode transfer_id={self.transfer_id}",
            record=self.p is None,
        )

    def _sign(self, leg: DecodeLeg) -> DecodeLeg:
        """The router's signature over P's coordinates, for this transfer only."""
        assert self.config.auth_secret is not None
        now_ms = time.time_ns() // 1_000_000
        return sign_decode_leg(
            leg, self.config.auth_secret, now_ms, int(self.config.coords_ttl_s * 1000)
        )

    # -- serving -----------------------------------------------------------------------

    async def serve(self, send: Send) -> None:
        """Answer the client through ``send``; always leaves both legs closed or (P only,
        after D finished) running to its own deadline."""
        try:
            await self._serve(send)
        finally:
            await self._cleanup()

    async def _serve(self, send: Send) -> None:
        logger.debug(
            "router dispatch request_id=%s transfer_id=%s P=%s D=%s",
            self.request_id,
            self.transfer_id,
            self.p.backend.name if self.p is not None else "none (degraded)",
            self.d.backend.name,
        )
        if self.config.first_token is FirstToken.PREFILL:
            self.trace.first_token(
                "prefill" if self.first_token else "decode", self.first_token_blocker
            )
        if self.first_token:
            return await self._serve_first_token(send)
        if self.p is None:
            watch = PrefillWatch(None)
            decode = self._decode()
        elif self.config.mode is Mode.PULL:
            answer = await self._prefill_first(send)
            if answer is None:
                return
            params = answer.get(PARAMS_FIELD)
            if not isinstance(params, dict):
                no_params = UpstreamError(
                    502,
                    f"{self.p.backend.name} returned no kv_transfer_params",
                    backend=self.p.backend.name,
                )
                self.p.backend.record_leg_failure(suspect=True)
                return await self._fail_early(send, no_params, Role.PREFILL)
            params = legs.apply_pull_overrides(params, self.p.backend.override)
            watch = PrefillWatch(None)
            decode = self._decode(params)
        else:
            p = self.p
            # Both legs leave now. The P leg is a task so that D's relay can watch it. P's
            # prefill is the long pole (D only has to register before it ends), so its task
            # gets the loop first and sends its request before D's is built; under load the
            # task would otherwise queue behind D's send (a late prefill_leg in the traces).
            self._p_task = asyncio.create_task(self._prefill(), name=f"prefill-{self.transfer_id}")
            self._p_task.add_done_callback(lambda _t: p.release())
            watch = PrefillWatch(self._p_task)
            await asyncio.sleep(0)
            decode = self._decode()
        try:
            opened = await watch.run(decode)
        except UpstreamError as err:
            self._d_error = err.message
            role = await self.blame_decode(err, answered=err.body is not None)
            if role is Role.DECODE:
                self.d.backend.record_leg_failure(suspect=err.suspect)
            self._cancel_prefill()
            return await self._fail_early(send, err, role)
        if isinstance(opened, _PrefillFailed):
            assert watch.failure is not None
            self._d_error = "prefill leg failed"
            return await self._fail_early(send, watch.failure, Role.PREFILL)
        self._d_resp = opened
        if self.stream:
            await self._relay_stream(send, opened, watch)
        else:
            await self._relay_whole(send, opened, watch)

    async def _prefill_first(self, send: Send) -> dict[str, Any] | None:
        """P's leg before D's (pull, first token from P): its answer, or None once its
        failure has been answered (or left to the next attempt)."""
        assert self.p is not None
        try:
            return await self._prefill()
        except UpstreamError as err:
            await self._fail_early(send, err, Role.PREFILL)
            return None
        finally:
            self.p.release()

    async def _serve_first_token(self, send: Send) -> None:
        """P first; the client gets its token as soon as P answers, then D continues from it.
        P's blocks wait for D's registration as in either order of the push protocol."""
        assert self.p is not None
        p = self.p.backend
        answer = await self._prefill_first(send)
        if answer is None:
            return
        try:
            token = first_token.PrefillToken.read(answer)
        except RemoteProtocolError as exc:
            p.record_leg_failure(suspect=True)
            unusable = UpstreamError(502, f"{p.name}: {exc}", backend=p.name)
            return await self._fail_early(send, unusable, Role.PREFILL)
        stamp = TraceStamp(self.trace.trace_id)
        await send(_start(200, "text/event-stream", self.request_id))
        if token.stopped:
            # No D leg: P's blocks wait for a registration until their lease ends (lease_s).
            self._d_done = True
            events = stamp.feed(first_token.first_event(token))
            events += stamp.feed(first_token.final_events(token, self.body))
            self.trace.sent(events, stream=True)
            return await _send_body(send, events)
        event = stamp.feed(first_token.first_event(token))
        await send({"type": "http.response.body", "body": event, "more_body": True})
        self.trace.sent(event, stream=True)
        try:
            resp = await self._decode(token=token)
        except UpstreamError as err:
            self._d_error = err.message
            self.d.backend.record_leg_failure(suspect=err.suspect)
            return await _send_body(send, err.sse())
        self._d_resp = resp
        await self._relay_stream(
            send, resp, PrefillWatch(None), started=True, rewrite=first_token.count_token_as_output
        )

    async def blame_decode(self, err: UpstreamError, *, answered: bool) -> Role:
        """Whose failure D's error answer is. D answers an error when the KV it waited for
        cannot come: its P died before the push (``peer_lost``), and vLLM's
        ``kv_load_failure_policy: fail`` turns that into a 500. That is P's failure: D is
        not marked suspect for it, P is taken out of rotation, and the next attempt avoids
        P (D alone, or another P). So when D ``answered`` an error (not a broken
        connection) and this attempt's P is gone (its leg failed, or its /health fails
        now), P is to blame; otherwise D, as before. The caller counts D's failure."""
        d = self.d.backend
        if self.p is not None and err.suspect and answered:
            why = await self._prefill_gone()
            if why is not None:
                logger.warning(
                    "router request_id=%s: %s answered %d with its P gone (%s): P's failure,"
                    " not D's",
                    self.request_id,
                    d.name,
                    err.status,
                    why,
                )
                return Role.PREFILL
        return Role.DECODE

    async def _prefill_gone(self) -> str | None:
        """Why this attempt's P is gone, or None while it looks alive."""
        assert self.p is not None
        task = self._p_task
        if task is not None and task.done() and not task.cancelled():
            exc = task.exception()
            if exc is not None:
                return f"its leg failed: {exc}"
        p = self.p.backend
        try:
            r = await p.http.request("GET", "/health", timeout_s=self.config.health_timeout_s)
        except TransportError as exc:
            # A refused connection is an answer (down at once); a timeout may be a loaded
            # host, which the health loop tolerates a few times.
            p.load.record_health(False, answered=exc.kind != "timeout")
            return f"/health: {exc.kind}: {exc}"
        if r.status_code != 200:
            p.load.record_health(False)
            return f"/health answered {r.status_code}"
        return None

    def _stream_error(self, events: bytes) -> UpstreamError | None:
        """D's stream opening with an error event instead of a token: what vLLM streams
        when the request fails before its first token (a failed KV load under
        ``kv_load_failure_policy: fail``). Nothing has reached the client yet."""
        if not events.startswith(b'data: {"error"'):
            return None
        try:
            payload = json.loads(events[6 : events.index(b"\n\n")])
            status = int(payload["error"].get("code") or 500)
        except (ValueError, KeyError, TypeError, AttributeError):
            status = 500
        d = self.d.backend
        return UpstreamError(
            status if 500 <= status < 600 else 500,
            f"{d.name} streamed an error before its first token "
            f"(decode transfer_id={self.transfer_id})",
            backend=d.name,
            suspect=True,
        )

    def _response_start(self, resp: Stream) -> dict[str, Any]:
        return _start(resp.status_code, resp.content_type or "application/json", self.request_id)

    async def _relay_whole(self, send: Send, resp: Stream, watch: PrefillWatch) -> None:
        try:
            body = await watch.run(resp.read())
        except TransportError as exc:
            return await self._decode_failed(send, exc, started=False)
        if isinstance(body, _PrefillFailed):
            assert watch.failure is not None
            self._d_error = "prefill leg failed"
            return await self._fail_early(send, watch.failure, Role.PREFILL)
        self.trace.decode_bytes()
        self._d_done = True
        await send(self._response_start(resp))
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self.trace.sent(body, stream=False)

    async def _relay_stream(
        self,
        send: Send,
        resp: Stream,
        watch: PrefillWatch,
        *,
        started: bool = False,
        rewrite: Callable[[bytes], bytes] | None = None,
    ) -> None:
        # The client's answer starts with D's first chunk, not D's headers: until then a
        # failure of either leg is still a plain error answer, or another attempt.
        # ``started``: it already has (P's token was sent). ``rewrite``: applied to whole events.
        stamp = TraceStamp(self.trace.trace_id)
        tail = b"\n\n"

        async def forward(data: bytes) -> None:
            nonlocal started, tail
            if not data:
                return
            if rewrite is not None:
                data = rewrite(data)
            if not started:
                started = True
                await send(self._response_start(resp))
            self.trace.decode_bytes()
            tail = (tail + data)[-len(SSE_DONE) :]
            await send({"type": "http.response.body", "body": data, "more_body": True})
            self.trace.sent(data, stream=True)
            if tail == SSE_DONE:
                self._d_done = True  # the client has it all and may hang up now

        while True:
            try:
                chunk = await watch.run(resp.next_chunk())
            except TransportError as exc:
                await forward(stamp.flush())  # what D sent before it broke, as before
                return await self._decode_failed(send, exc, started=started, tail=tail)
            if isinstance(chunk, _PrefillFailed):
                assert watch.failure is not None
                self._d_error = "prefill leg failed"
                await forward(stamp.flush())
                if not started:
                    return await self._fail_early(send, watch.failure, Role.PREFILL)
                return await _send_body(send, _event_break(tail) + watch.failure.sse())
            if chunk is None:
                break
            events = stamp.feed(chunk)
            if not started and (early := self._stream_error(events)) is not None:
                if await self._retry_stream_error(early):
                    return
            await forward(events)
        await forward(stamp.flush())
        self._d_done = True
        if not started:
            await send(self._response_start(resp))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _retry_stream_error(self, err: UpstreamError) -> bool:
        """D's stream opened with an error event: True when it is left to the next attempt
        (P is to blame and one is allowed); else it goes to the client as D sent it."""
        if not self._may_retry or self.p is None:
            return False
        if await self.blame_decode(err, answered=True) is not Role.PREFILL:
            return False
        self._d_error = err.message
        self._cancel_prefill()
        self.retry = Retry(Role.PREFILL, err)
        return True

    async def _decode_failed(
        self, send: Send, exc: TransportError, *, started: bool, tail: bytes = b"\n\n"
    ) -> None:
        """D broke mid-answer (timeout between bytes, dropped connection)."""
        d = self.d.backend
        err = from_exception(exc, d, f"decode transfer_id={self.transfer_id}")
        self._d_error = err.message
        d.record_leg_failure(suspect=True)
        logger.warning("router decode leg failed: %s", err.message)
        self._cancel_prefill()  # nobody will consume P's KV now
        if started:
            await _send_body(send, _event_break(tail) + err.sse())
        else:
            await self._fail_early(send, err, Role.DECODE)

    async def _fail_early(self, send: Send, err: UpstreamError, role: Role) -> None:
        """A leg failed before the client got a byte: leave it to the next attempt when the
        backend is at fault (not a 4xx refusal) and one is allowed; else answer the error."""
        if self._may_retry and err.suspect:
            self.retry = Retry(role, err)
            return
        await send_error(send, err, self.request_id)

    async def settled(self) -> None:
        """Wait for a cancelled P leg to finish unwinding, so its span ends before the next
        attempt starts its own (cancellation only closes the connection: quick)."""
        task = self._p_task
        if task is not None and not task.done():
            await asyncio.wait([task])

    # -- cleanup -----------------------------------------------------------------------

    def _cancel_prefill(self) -> None:
        if self._p_task is not None and not self._p_task.done():
            self._p_task.cancel()

    async def _cleanup(self) -> None:
        task = self._p_task
        if task is not None and not task.done():
            if self._d_done:
                # D's answer is out; P's HTTP answer is only bookkeeping. Let it end on its
                # own (its deadline bounds it) and keep a reference until then.
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            else:
                task.cancel()
        if self.config.mode is Mode.PULL and self.p is not None:
            self.p.release()
        if self._d_resp is not None:
            self._d_resp.close()  # closes the connection unless D's answer was read whole
        self.d.release()
        self.trace.decode_ended(
            None if self._d_done else (self._d_error or Outcome.CANCELLED.value)
        )


_FINISHED = re.compile(rb'"finish_reason":\s*"')
_USAGE_ONLY = re.compile(rb'"choices":\s*\[\]')


class TraceStamp:
    """Puts ``"pushkv_trace_id"`` into a stream's closing events (a choice's finish, the
    usage event), a field OpenAI clients ignore. It passes whole SSE events on as soon as
    they are complete (a client cannot use half an event anyway), so it delays nothing."""

    def __init__(self, trace_id: str) -> None:
        self._field = b'"pushkv_trace_id":"' + trace_id.encode() + b'",'
        self._rest = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._rest + chunk
        cut = data.rfind(b"\n\n") + 2
        if cut < 2:
            self._rest = data
            return b""
        ready, self._rest = data[:cut], data[cut:]
        if not (_FINISHED.search(ready) or _USAGE_ONLY.search(ready)):
            return ready  # the usual event: as it came
        return b"\n\n".join(self._stamp(e) for e in ready.split(b"\n\n"))

    def _stamp(self, event: bytes) -> bytes:
        if event.startswith(b"data: {") and (
            _FINISHED.search(event) or (_USAGE_ONLY.search(event) and b'"usage":{' in event)
        ):
            return b"data: {" + self._field + event[7:]
        return event

    def flush(self) -> bytes:
        rest, self._rest = self._rest, b""
        return rest


def _event_break(tail: bytes) -> bytes:
    """Make sure an error event does not glue onto a half-sent SSE event."""
    return b"" if tail.endswith(b"\n\n") else b"\n\n"


async def _send_body(send: Send, body: bytes) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _start(status: int, content_type: str, request_id: str) -> dict[str, Any]:
    return {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", content_type.encode()),
            (b"x-request-id", request_id.encode()),
        ],
    }


async def send_error(send: Send, err: UpstreamError, request_id: str) -> None:
    body, ctype = err.http_body()
    await send(_start(err.status, ctype, request_id))
    await _send_body(send, body)
