"""The scheduler role's intake of a new request's pushkv leg, and the record it starts.

Owns: ``ReqRecord``, the scheduler role's one record per request that carries a leg, and
``LegIntake``, which turns a request's ``kv_transfer_params`` into that record: a leg
written for NixlConnector adapted (core/pairing.py), given a trace if it names none
(core/leg_trace.py), the leg parsed (kv_params.py), and on D the P coordinates it names
checked against ``LegTrust`` before anything dials them. An
untrusted leg is computed locally or refused, logged sparsely and reported as a
``leg_rejected`` span in the request's trace.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from connector.core import leg_trace, pairing
from connector.core import lifecycle as lc
from connector.core.lifecycle import ReqState
from connector.engine_spans import emit_leg_rejected
from connector.kv_params import (
    DecodeLeg,
    LegTrust,
    PrefillLeg,
    UntrustedLeg,
    parse_decode_leg,
    parse_prefill_leg,
)

logger = logging.getLogger(__name__)


@dataclass
class ReqRecord:
    request: Any  # vLLM's live Request: the scheduler keeps its counters current
    state: ReqState
    prefill: PrefillLeg | None = None
    decode: DecodeLeg | None = None
    error: str = ""
    # Wall-clock times for spans: P first scheduled; D KV complete (as seen here), first
    # step scheduled; D tokens it held itself.
    scheduled_ns: int = 0
    kv_ns: int = 0
    first_step_ns: int = 0
    local_tokens: int = 0
    load_block: int | None = None  # D: the first block its load writes (vLLM 0.26)
    # P: the leg came without a transfer_id (a router written for NixlConnector), so the
    # answer also speaks NixlConnector's terms (core/pairing.py).
    foreign: bool = False


class LegIntake:
    def __init__(
        self,
        engine_id: str,
        is_producer: bool,
        is_consumer: bool,
        trust: LegTrust,
        refuse_untrusted: bool,
        tracer: Any,
    ) -> None:
        self._engine_id = engine_id
        self._producer, self._consumer = is_producer, is_consumer
        self._trust = trust  # D: whose P coordinates a decode leg may name
        self._refuse = refuse_untrusted  # untrusted_leg: refuse (else computed locally)
        self.tracer = tracer  # D's engine tracer (leg_rejected spans), or None
        self.untrusted_legs = 0

    def record(self, request: Any, report: bool = True) -> ReqRecord | None:
        """The record ``request`` starts as; None if it carries no leg for this engine's
        roles. An untrusted D leg is never dialed, and reported if ``report``. Raises
        ``KvParamsError`` or ``pairing.ForeignLegError`` for a leg that does not parse."""
        rid = request.request_id
        params, foreign = pairing.adapt(request.kv_transfer_params, rid)
        params = leg_trace.with_trace(params, getattr(request, "trace_headers", None))
        if self._producer and (leg := parse_prefill_leg(params)) is not None:
            start = lc.start(lc.PrefillLegAdded(rid))
            return ReqRecord(request, start, prefill=leg, foreign=foreign)
        if self._consumer and (dleg := parse_decode_leg(params)) is not None:
            rec = self._decode_record(request, dleg)  # trusted or not: before any dial
            if rec.error and report:
                self._untrusted(rid, dleg, rec.error)
            return rec
        return None

    def _decode_record(self, request: Any, leg: DecodeLeg) -> ReqRecord:
        """D: a new request's record. A leg naming P coordinates D may not dial is never
        dialed: computed locally (LegRejected), or refused (LegRefused: its load is failed);
        either way ``error`` says why."""
        rid = request.request_id
        try:
            self._trust.check(leg, time.time_ns() // 1_000_000)
        except UntrustedLeg as exc:
            if self._refuse:
                why = f"{exc}; refused (untrusted_leg: refuse)"
                return ReqRecord(request, lc.start(lc.LegRefused(rid)), decode=leg, error=why)
            return ReqRecord(request, lc.start(lc.LegRejected(rid)), error=str(exc))
        return ReqRecord(request, lc.start(lc.DecodeLegAdded(rid)), decode=leg)

    def _untrusted(self, rid: str, leg: DecodeLeg, why: str) -> None:
        """Never dialed, computed locally or refused: logged 1st, 2nd, 4th... (a flood
        stays quiet), and a ``leg_rejected`` span in the request's trace."""
        self.untrusted_legs += 1
        n = self.untrusted_legs
        if n & (n - 1) == 0:
            then = "" if self._refuse else "; computing it locally"
            logger.warning("Request %s: %s%s (%d so far)", rid, why, then, n)
        emit_leg_rejected(
            self.tracer,
            leg.trace(),
            transfer_id=leg.transfer_id,
            request_id=rid,
            engine_id=self._engine_id,
            peer=f"{leg.remote_host}:{leg.remote_port}",
            reason=why,
            at_ns=time.time_ns(),
        )
