"""One attempt at a client request: its two legs and the rules every mode shares.

Owns: ``Retry`` (an attempt that failed before the client's first byte) and ``Attempt``:
the attempt's ids, one ``LegTrack`` per leg, sending P's leg (``prefill``) and opening
D's (``open_decode``), whose failure D's error answer is (``blame_decode``), answering or
leaving a failure to the next attempt (``fail_early``, ``decode_failed``), and closing
both legs at the end (``cleanup``). The order in which the legs run is the mode's
(``modes.py``); relaying D's answer is ``decode_relay.py``.

Must not import: uvicorn, ``connector.router.app``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from starlette.types import Send

from connector.kv_params import DecodeLeg, sign_decode_leg
from connector.router import first_token, legs
from connector.router.answer import event_break, send_body, send_error
from connector.router.backends import Lease, Role
from connector.router.config import FirstToken, Mode, RouterConfig
from connector.router.legstate import LegEvent, LegState, LegTrack
from connector.router.response_homes import ResponseIdReader
from connector.router.tracing import RequestTrace
from connector.router.upstream import (
    Stream,
    TransportError,
    UpstreamError,
    from_exception,
    open_stream,
    post_json,
)
from telemetry.schema import Outcome

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retry:
    """Why an attempt ended without answering: a leg of ``role`` failed before the client
    got a byte, and another attempt is allowed."""

    role: Role
    error: UpstreamError


class Attempt:
    """One attempt: routed to one P and one D, or (degraded, ``p`` None) to D alone with
    the client's body as is, so D computes the prompt itself. With ``may_retry``, a leg
    failing before the client got a byte (connect error, timeout, 5xx) leaves ``retry``
    set and nothing sent; the caller runs the next attempt."""

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
        answer_id: ResponseIdReader | None = None,
    ) -> None:
        self.config, self.endpoint, self.body = config, endpoint, body
        self.p, self.d = p, d
        # Read once: a health check may drop P's coordinates while this request runs.
        self.coords = p.backend.coords if p is not None else None
        self.may_retry = may_retry
        self.retry: Retry | None = None
        self.answer_id = answer_id  # reads D's answer's id as it goes out (/v1/responses)
        self.request_id, self.trace, self._authorization = request_id, trace, authorization
        self.stream = bool(body.get("stream", False))
        self.transfer_id = (
            legs.vllm_transfer_id() if config.mode is Mode.VLLM_PUSH else legs.new_transfer_id()
        )
        self._background = background
        # First token from P: asked for, and this request allows it (else why not).
        self.first_token_blocker: str | None = None
        if config.first_token is FirstToken.PREFILL and p is not None:
            self.first_token_blocker = first_token.blocker(endpoint, body)
        self.p_leg = LegTrack(Role.PREFILL)
        self.d_leg = LegTrack(Role.DECODE)

    @property
    def first_token_from_p(self) -> bool:
        """P's token goes to the client first (``--first-token prefill``, allowed here)."""
        return (
            self.config.first_token is FirstToken.PREFILL
            and self.p is not None
            and self.first_token_blocker is None
        )

    # -- the two legs ------------------------------------------------------------------

    async def prefill(self) -> dict[str, Any]:
        """P's leg, whole: its answer, or ``UpstreamError``."""
        leg = self.p_leg
        leg.on(LegEvent.SENT)
        error: str | None = Outcome.CANCELLED.value
        try:
            answer = await self._prefill_leg()
            error = None
            leg.on(LegEvent.COMPLETED)
            return answer
        except UpstreamError as err:
            error = err.message
            leg.on(LegEvent.FAILED, err.message)
            raise
        except asyncio.CancelledError:
            leg.on(LegEvent.CANCELLED)
            raise
        except Exception as exc:
            leg.on(LegEvent.FAILED, str(exc))
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
            token_ids=self.first_token_from_p,
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

    def open_decode(
        self,
        prefill_params: dict[str, Any] | None = None,
        token: first_token.PrefillToken | None = None,
    ) -> Awaitable[Stream]:
        """Send D's leg; ``token``: continued from P's token (first token from P)."""
        d = self.d.backend
        traceparent = self.trace.decode_started(d.url)
        self.d_leg.on(LegEvent.SENT)
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

    def decode_opened(self, stream: Stream) -> None:
        self.d_leg.stream = stream
        self.d_leg.on(LegEvent.OPENED)

    # -- whose failure, and what the client gets ------------------------------------------

    async def blame_decode(self, err: UpstreamError, *, answered: bool) -> Role:
        """Whose failure D's error answer is. D answers an error when the KV it waited for
        cannot come: its P died before the push (``peer_lost``), and vLLM's
        ``kv_load_failure_policy: fail`` turns that into a 500. That is P's failure: D is
        not marked suspect for it, P is taken out of rotation, and the next attempt avoids
        P (D alone, or another P). So when D ``answered`` an error (not a broken
        connection) and this attempt's P is gone (its leg failed, or its /health fails
        now), P is to blame; otherwise D. The caller counts D's failure."""
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
        if self.p_leg.state is LegState.FAILED:
            return f"its leg failed: {self.p_leg.reason}"
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

    async def fail_early(self, send: Send, err: UpstreamError, role: Role) -> None:
        """A leg failed before the client got a byte: leave it to the next attempt when the
        backend is at fault (not a 4xx refusal) and one is allowed; else answer the error."""
        if self.may_retry and err.suspect:
            self.retry = Retry(role, err)
            return
        await send_error(send, err, self.request_id)

    async def prefill_failed(self, send: Send, err: UpstreamError, *, tail: bytes | None) -> None:
        """P's leg failed while D's was open: D is closed (vLLM aborts the request). ``tail``:
        the end of what the client has of D's stream, None while it has nothing."""
        self.d_leg.on(LegEvent.CANCELLED, "prefill leg failed")
        if tail is None:
            return await self.fail_early(send, err, Role.PREFILL)
        await send_body(send, event_break(tail) + err.sse())

    async def decode_failed(
        self, send: Send, exc: TransportError, *, started: bool, tail: bytes = b"\n\n"
    ) -> None:
        """D broke mid-answer (timeout between bytes, dropped connection)."""
        d = self.d.backend
        err = from_exception(exc, d, f"decode transfer_id={self.transfer_id}")
        self.d_leg.on(LegEvent.FAILED, err.message)
        d.record_leg_failure(suspect=True)
        logger.warning("router decode leg failed: %s", err.message)
        self.cancel_prefill()  # nobody will consume P's KV now
        if started:
            await send_body(send, event_break(tail) + err.sse())
        else:
            await self.fail_early(send, err, Role.DECODE)

    # -- the end -----------------------------------------------------------------------

    def cancel_prefill(self) -> None:
        task = self.p_leg.task
        if task is not None and not task.done():
            task.cancel()

    async def settled(self) -> None:
        """Wait for a cancelled P leg to finish unwinding, so its span ends before the next
        attempt starts its own (cancellation only closes the connection: quick)."""
        task = self.p_leg.task
        if task is not None and not task.done():
            await asyncio.wait([task])

    def cleanup(self) -> None:
        """Close both legs: P's runs on to its own deadline once D's answer is out."""
        task = self.p_leg.task
        if task is not None and not task.done():
            if self.d_leg.state is LegState.DONE:
                # D's answer is out; P's HTTP answer is only bookkeeping. Let it end on its
                # own (its deadline bounds it) and keep a reference until then.
                if self.p_leg.state is LegState.SENT:
                    self.p_leg.on(LegEvent.DETACHED)
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            else:
                task.cancel()
        if self.config.mode is Mode.PULL and self.p is not None:
            self.p.release()
        if self.d_leg.stream is not None:
            self.d_leg.stream.close()  # closes the connection unless D's answer was read whole
        if self.d_leg.open:
            self.d_leg.on(LegEvent.CANCELLED)  # the client left
        self.d.release()
        self.trace.decode_ended(self.d_leg.outcome())
