"""D's receive tracker: one record per transfer this D rank waits for.

Owns: the records, their deadlines (overall timeout, the grace after a cancel,
tombstones), the heartbeat schedule and the drop counters. Transitions live in state.py.
D reports a transfer (finished_recving) only once no source can still write into its
blocks. Pure: no threads, no clocks, no vLLM, no NIXL; one thread calls it.
"""

from __future__ import annotations

from collections import defaultdict

from connector.core import events as ev
from connector.core.messages import FailReason, PeerAddr
from connector.core.recv_state import (
    ReceiverPolicy,
    RecvCtx,
    RecvRecord,
    RecvState,
    SourceState,
    recv_transition,
)
from connector.core.table import TransferTable
from connector.core.transition import DeadlinePassed

RecvTableEvent = ev.RecvEvent | DeadlinePassed


class ReceiverTable(TransferTable[RecvRecord, RecvTableEvent, ev.RecvAction]):
    """Feed events in, get actions out. Remote misbehaviour is dropped and counted."""

    def __init__(self, policy: ReceiverPolicy = ReceiverPolicy()) -> None:
        super().__init__()
        self.policy = policy
        self._next_heartbeat_ns: int | None = None
        self.abandoned = 0

    def handle(self, event: ev.RecvEvent | ev.PeerLost, now_ns: int) -> list[ev.RecvAction]:
        if isinstance(event, ev.PeerLost):
            return self._peer_lost(event.agent, now_ns)
        if isinstance(event, ev.Expected) and not self.live[RecvState.AWAITING]:
            # D starts waiting: the first heartbeat is one interval away. A transfer that
            # ends sooner costs none; one whose answer was lost learns of it then (P
            # answers a heartbeat for a transfer it ended).
            self._next_heartbeat_ns = now_ns + self.policy.heartbeat_interval_ns
        return self._apply_counted(event.transfer_id, event, now_ns)

    def tick(self, now_ns: int) -> list[ev.RecvAction]:
        """Fire due deadlines, forget old tombstones, and send heartbeats when due."""
        out: list[ev.RecvAction] = []
        for tid in self._due(now_ns):
            out += self._apply_counted(tid, DeadlinePassed(tid), now_ns)
        if self._next_heartbeat_ns is None or now_ns >= self._next_heartbeat_ns:
            out += self._heartbeats()
            self._next_heartbeat_ns = now_ns + self.policy.heartbeat_interval_ns
        return out

    def shut_down(self, now_ns: int) -> list[ev.RecvAction]:
        """Shutting down: cancel every transfer still awaited (``ShutdownDue``); each is
        reported failed once its sources answer (or can no longer write)."""
        out: list[ev.RecvAction] = []
        if not self.live[RecvState.AWAITING]:
            return out
        for tid in [t for t, r in self._records.items() if r.state is RecvState.AWAITING]:
            out += self._apply_counted(tid, ev.ShutdownDue(tid), now_ns)
        return out

    def _apply_counted(self, tid: str, event: RecvTableEvent, now_ns: int) -> list[ev.RecvAction]:
        rec = self._records.get(tid)
        was_abandoned = rec.abandoned if rec is not None else False
        ctx = RecvCtx(now_ns, self.policy)
        actions = self._apply(tid, event, lambda r, e: recv_transition(r, e, ctx))
        rec = self._records.get(tid)
        if rec is not None and rec.abandoned and not was_abandoned:
            self.abandoned += 1
        return actions

    def _peer_lost(self, agent: str, now_ns: int) -> list[ev.RecvAction]:
        out: list[ev.RecvAction] = []
        for rec in list(self._records.values()):
            for p_rank, src in rec.sources.items():
                if src.addr.agent == agent and rec.status[p_rank] is SourceState.PENDING:
                    out += self._apply_counted(
                        rec.transfer_id,
                        ev.SendFailed(rec.transfer_id, p_rank, FailReason.PEER_LOST),
                        now_ns,
                    )
        return out

    def _heartbeats(self) -> list[ev.SendHeartbeat]:
        by_peer: dict[PeerAddr, list[str]] = defaultdict(list)
        for rec in self._records.values():
            if rec.state is RecvState.AWAITING:
                for src in rec.pending():
                    by_peer[src.addr].append(rec.transfer_id)
        return [ev.SendHeartbeat(addr, tuple(ids)) for addr, ids in by_peer.items()]

    # ------------------------------------------------------------------ queries
    def next_deadline_ns(self) -> int | None:
        d = super().next_deadline_ns()
        if self._next_heartbeat_ns is not None and self.live[RecvState.AWAITING]:
            d = self._next_heartbeat_ns if d is None else min(d, self._next_heartbeat_ns)
        return d

    def awaiting_network(self) -> bool:
        return any(not r.state.terminal for r in self._records.values())
