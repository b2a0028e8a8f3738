"""D's ``first_token`` span: from a request's KV complete to its first token out.

Owns: ``FirstTokenWatch``, the D requests whose KV arrived and whose first token is not out
yet. vLLM tells the connector neither when such a request is scheduled nor when its first
token is out, so both are polled each step (the scheduler appends a step's tokens before
it calls ``update_connector_output``).
"""

from __future__ import annotations

from typing import Any

from connector.engine_spans import emit_first_token
from connector.leg_intake import ReqRecord


class FirstTokenWatch:
    def __init__(self, engine_id: str, tracer: Any) -> None:
        self._engine_id = engine_id
        self._tracer = tracer
        self._recs: dict[str, ReqRecord] = {}

    def __bool__(self) -> bool:
        return bool(self._recs)

    def __contains__(self, rid: str) -> bool:
        return rid in self._recs

    def watch(self, rid: str, rec: ReqRecord, now: int) -> None:
        """``rid``'s KV is complete at ``now``: time its first token."""
        rec.kv_ns = now
        self._recs[rid] = rec

    def poll(self, scheduled: Any, now: int) -> None:
        """Once a step; ``scheduled``: the request ids this step schedules."""
        for rid, rec in list(self._recs.items()):
            if rec.request.num_output_tokens > 0:
                self.out(rid, now)
            elif not rec.first_step_ns and rid in scheduled:
                rec.first_step_ns = now

    def out(self, rid: str, now: int) -> None:
        """``rid``'s first token is out (or the request finished without one): its span."""
        rec = self._recs.pop(rid)
        assert rec.decode is not None
        emit_first_token(
            self._tracer,
            rec.decode.trace(),
            transfer_id=rec.decode.transfer_id,
            request_id=rid,
            engine_id=self._engine_id,
            kv_ns=rec.kv_ns,
            scheduled_ns=rec.first_step_ns,
            out_ns=now,
            local_tokens=rec.local_tokens,
            error=None if rec.request.num_output_tokens > 0 else "no_token",
        )
