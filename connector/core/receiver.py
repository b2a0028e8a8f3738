"""D's receive tracker: one record per transfer this D rank waits for.

Owns: the records, their deadlines (overall timeout, the grace after a cancel,
tombstones), the heartbeat schedule and the drop counters. Transitions live in state.py.
D reports a transfer (finished_recving) only once no source can still write into its
blocks. Pure: no threads, no clocks, no vLLM, no NIXL; one thread calls it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from connector.core import events as ev
from connector.core.deadlines import DeadlineHeap
from connector.core.errors import RemoteProtocolError
from connector.core.messages import FailReason, PeerAddr
from connector.core.state import (
    DeadlinePassed,
    ReceiverPolicy,
    RecvCtx,
    RecvRecord,
    RecvState,
    SourceState,
    recv_transition,
)


class ReceiverTable:
    """Feed events in, get actions out. Remote misbehaviour is dropped and counted."""

    def __init__(self, policy: ReceiverPolicy = ReceiverPolicy()) -> None:
        self.policy = policy
        self._records: dict[str, RecvRecord] = {}
        self._deadlines = DeadlineHeap()
        self._next_heartbeat_ns: int | None = None
        self.dropped: Counter[str] = Counter()
        self.abandoned = 0
        self.last_drop = ""

    def handle(self, event: ev.ReceiverEvent | ev.PeerLost, now_ns: int) -> list[Any]:
        if isinstance(event, ev.PeerLost):
            return self._peer_lost(event.agent, now_ns)
        return self._apply(event.transfer_id, event, now_ns)

    def tick(self, now_ns: int) -> list[Any]:
        """Fire due deadlines, forget old tombstones, and send heartbeats when due."""
        out: list[Any] = []
        for tid in list(self._deadlines.pop_due(now_ns, self._deadline_of)):
            rec = self._records[tid]
            if rec.state.terminal:
                del self._records[tid]
                continue
            out += self._apply(tid, DeadlinePassed(tid), now_ns)
        if self._next_heartbeat_ns is None or now_ns >= self._next_heartbeat_ns:
            out += self._heartbeats()
            self._next_heartbeat_ns = now_ns + self.policy.heartbeat_interval_ns
        return out

    def _apply(self, tid: str, event: Any, now_ns: int) -> list[Any]:
        rec = self._records.get(tid)
        before = rec.deadline_ns if rec is not None else None
        was_abandoned = rec.abandoned if rec is not None else False
        try:
            rec, actions = recv_transition(rec, event, RecvCtx(now_ns, self.policy))
        except RemoteProtocolError as exc:
            self.dropped[type(event).__name__] += 1
            self.last_drop = str(exc)
            return []
        if rec is not None:
            self._records[tid] = rec
            if rec.deadline_ns != before:
                self._deadlines.push(rec.deadline_ns, tid)
            if rec.abandoned and not was_abandoned:
                self.abandoned += 1
        return actions

    def _peer_lost(self, agent: str, now_ns: int) -> list[Any]:
        out: list[Any] = []
        for rec in list(self._records.values()):
            for p_rank, src in rec.sources.items():
                if src.addr.agent == agent and rec.status[p_rank] is SourceState.PENDING:
                    out += self._apply(rec.transfer_id,
                                       ev.SendFailed(rec.transfer_id, p_rank, FailReason.PEER_LOST), now_ns)
        return out

    def _heartbeats(self) -> list[ev.SendHeartbeat]:
        by_peer: dict[PeerAddr, list[str]] = defaultdict(list)
        for rec in self._records.values():
            if rec.state is RecvState.AWAITING:
                for src in rec.pending():
                    by_peer[src.addr].append(rec.transfer_id)
        return [ev.SendHeartbeat(addr, tuple(ids)) for addr, ids in by_peer.items()]

    # ------------------------------------------------------------------ queries
    def _deadline_of(self, tid: str) -> int | None:
        rec = self._records.get(tid)
        return rec.deadline_ns if rec is not None else None

    def next_deadline_ns(self) -> int | None:
        d = self._deadlines.next_ns()
        if self._next_heartbeat_ns is not None and any(
                r.state is RecvState.AWAITING for r in self._records.values()):
            d = self._next_heartbeat_ns if d is None else min(d, self._next_heartbeat_ns)
        return d

    def get(self, transfer_id: str) -> RecvRecord | None:
        return self._records.get(transfer_id)

    def state_of(self, transfer_id: str) -> RecvState | None:
        rec = self._records.get(transfer_id)
        return rec.state if rec is not None else None

    def awaiting_network(self) -> bool:
        return any(not r.state.terminal for r in self._records.values())

    def __len__(self) -> int:
        return len(self._records)
