"""D's side of the push protocol, run on the transfer thread.

Owns: turning the receive tracker's actions into notifications (registration, cancel,
heartbeat) and incoming notifications into tracker events. Transport via the Transport
protocol only; never vLLM. One thread calls it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import UNSET

from connector.core import events as ev
from connector.core import messages as m
from connector.core.errors import PeerDisconnected, TransportError
from connector.core.layout import KVLayout
from connector.core.receiver_table import ReceiverTable
from connector.core.state import ReceiverPolicy
from connector.transfer.guard import Guard
from connector.transfer.integrity import Check, verdict
from connector.transfer.peers import NotSent, Peers
from connector.transfer.spans import NO_SPANS, RegisterNote
from connector.transfer.topology import RankInfo
from telemetry.counts import Counts
from telemetry.schema import Count

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Received:
    """One transfer's outcome for the engine (finished_recving, failed_recving)."""

    transfer_id: str
    request_id: str
    ok: bool
    reason: m.FailReason | None
    at_ns: int = 0  # wall clock when the last completion was counted (or the failure decided)


class Receiver:
    """Registers D's blocks with each writing P rank and counts their completions."""

    def __init__(
        self,
        me: RankInfo,
        layout: KVLayout,
        peers: Peers,
        policy: ReceiverPolicy = ReceiverPolicy(),
        clock: Callable[[], int] = time.monotonic_ns,
        spans: Any = NO_SPANS,
        offer: m.IpcOffer | None = None,
        guard: Guard | None = None,
        verify_checksums: bool = False,
    ) -> None:
        """``offer``: D's KV for mapping (GPU, ``connector.transfer.gpu.paths.make_offer``),
        sent to each P rank before the first registration; P may ignore it.
        ``verify_checksums``: check the digest a completion carries against D's blocks; a
        mismatch fails the load (``checksum_mismatch``). Off: digests are ignored."""
        self._verify = verify_checksums
        self._skips: set[str] = set()  # why digests went unchecked, each logged once
        layout.validate()
        self._codec = guard if guard is not None else Guard()  # seals when a secret is set
        self._clock = clock
        self.spans = spans  # connector.transfer.spans.TransferSpans, or NO_SPANS
        self.me, self.layout, self.peers, self.policy = me, layout, peers, policy
        self.table = ReceiverTable(policy)
        self._expected: dict[str, ev.Expected] = {}
        self._offer = offer
        self._offered: set[str] = set()  # P agents that have our offer
        self.finished: list[Received] = []
        self.counters: Counts = Counts()

    # ------------------------------------------------------------------ inputs
    def on_event(
        self,
        event: ev.RecvEvent | ev.NotNeeded,
        now_ns: int,
        ready: object = None,
        note: RegisterNote | None = None,
    ) -> None:
        if isinstance(event, ev.NotNeeded):
            frame = self._cancel_frame(event.transfer_id, m.FailReason.NOT_NEEDED)
            for src in event.sources:
                self.peers.send(src.addr, frame, now_ns, self._count_failure)
            return
        if isinstance(event, ev.Expected):
            self._expected[event.transfer_id] = event
            self.spans.expected(event, note)
        self._run(self.table.handle(event, now_ns), now_ns)

    def on_message(self, agent: str, msg: m.Message, now_ns: int) -> None:
        if not isinstance(msg, (m.Completion, m.Fail)):
            self.counters.add(Count.UNEXPECTED, type(msg).__name__)
            return
        exp = self._expected.get(msg.transfer_id)
        if exp is not None and not any(
            s.p_rank == msg.p_rank and s.addr.agent == agent for s in exp.sources
        ):
            self.counters.add(Count.SENDER_MISMATCH)  # a rank speaking for another: drop
            return
        if isinstance(msg, m.Completion):
            event: ev.RecvEvent = ev.CompletionSeen(msg.transfer_id, msg.p_rank)
            if self._verify and exp is not None and self._check(exp, msg) is Check.MISMATCH:
                event = ev.FailSeen(msg.transfer_id, msg.p_rank, m.FailReason.CHECKSUM_MISMATCH)
        else:
            event = ev.FailSeen(msg.transfer_id, msg.p_rank, msg.reason)
        self._run(self.table.handle(event, now_ns), now_ns)

    def _check(self, exp: ev.Expected, msg: m.Completion) -> Check:
        """Verify a completion's digest against our blocks (the WRITE has landed)."""
        check, why = verdict(self.layout, exp, msg.digest)
        self.counters.add(Count.KV_CHECK, check.value)
        self.spans.kv_checked(msg.transfer_id, check.value)
        if check is Check.MISMATCH:
            logger.error(
                "Transfer %s: the KV from P rank %d does not match its checksum (%s); the "
                "load fails (checksum_mismatch)",
                msg.transfer_id,
                msg.p_rank,
                why,
            )
        elif check is Check.SKIPPED and msg.digest is not None and why not in self._skips:
            self._skips.add(why)  # once per reason: it holds for every digest of its kind
            logger.warning("KV digests of algorithm %s are not checked: %s", msg.digest.algo, why)
        return check

    def poll(self, now_ns: int) -> None:
        nxt = self.table.next_deadline_ns()
        if nxt is not None and nxt <= now_ns:
            self._run(self.table.tick(now_ns), now_ns)

    def shut_down(self, now_ns: int) -> None:
        """Shutting down: cancel every transfer still awaited (reason ``shutdown``); each
        is reported failed once its P ranks answer, so no WRITE lands after."""
        self._run(self.table.shut_down(now_ns), now_ns)

    def busy(self) -> bool:
        return self.table.awaiting_network()

    def awaited_addrs(self) -> set[tuple[str, int]]:
        """Host and port of every P rank a transfer still expects (their doorbells)."""
        return {(s.addr.host, s.addr.port) for e in self._expected.values() for s in e.sources}

    # ------------------------------------------------------------------ actions
    def _run(self, actions: list[ev.RecvAction], now_ns: int) -> None:
        for a in actions:
            if isinstance(a, ev.SendRegister):
                self._send_register(a, now_ns)
            elif isinstance(a, ev.SendCancel):
                frame = self._cancel_frame(a.transfer_id, a.reason)
                for src in a.to:
                    self.peers.send(
                        src.addr, frame, now_ns, self._on_send_error(a.transfer_id, src)
                    )
            elif isinstance(a, ev.SendHeartbeat):
                ids = a.transfer_ids
                for i in range(0, len(ids), m.MAX_HEARTBEAT_IDS + 1):
                    chunk = ids[i : i + m.MAX_HEARTBEAT_IDS + 1]
                    frame = self._codec.encode(
                        m.Heartbeat(
                            transfer_id=chunk[0],
                            more_ids=chunk[1:],
                            d_rank=self.me.rank,
                            d_addr=self.me.addr,
                        )
                    )
                    self.peers.send(a.to, frame, now_ns, self._on_heartbeat_error(a.to))
                    self.counters.add(Count.HEARTBEATS_SENT)
            elif isinstance(a, ev.ReportReceived):
                self._expected.pop(a.transfer_id, None)
                rec = self.table.get(a.transfer_id)
                if not a.ok:
                    reason = a.reason.value if a.reason else "unknown"
                    self.counters.add(Count.RECV_FAILED, reason)
                if rec is not None and rec.abandoned:
                    self.counters.add(Count.RECV_ABANDONED)
                    logger.error("Transfer %s abandoned: a P rank never answered", a.transfer_id)
                elif not a.ok:
                    logger.warning(
                        "Transfer %s failed: %s",
                        a.transfer_id,
                        a.reason.value if a.reason else "unknown",
                    )
                at = time.time_ns()
                self.finished.append(Received(a.transfer_id, a.request_id, a.ok, a.reason, at))
                self.spans.received(a.transfer_id, a.ok, a.reason, at)
            else:
                raise TypeError(f"unknown receiver action {a!r}")

    def _cancel_frame(self, transfer_id: str, reason: m.FailReason) -> bytes:
        return self._codec.encode(
            m.Cancel(
                transfer_id=transfer_id, d_rank=self.me.rank, d_addr=self.me.addr, reason=reason
            )
        )

    def _send_register(self, a: ev.SendRegister, now_ns: int) -> None:
        exp = self._expected[a.transfer_id]
        agent = a.source.addr.agent
        if self._offer is not None and agent not in self._offered:
            # Before the registration, on the same ordered path: P has it when it matches.
            self._offered.add(agent)
            offer = msgspec.structs.replace(self._offer, transfer_id=a.transfer_id)
            self.peers.send(
                a.source.addr, self._codec.encode(offer), now_ns, self._offer_failed(agent)
            )

        def frame() -> bytes | None:
            # Built when sent (a dial may come first): ttl_ms is what is left until our
            # receive deadline, so P posts no WRITE after it (docs/protocol.md, Deadlines).
            rec = self.table.get(a.transfer_id)
            left_ms = (rec.expires_ns - self._clock()) // 1_000_000 if rec is not None else 0
            if left_ms < 1:
                return None
            return self._codec.encode(
                m.Register(
                    transfer_id=a.transfer_id,
                    d_engine_id=self.me.engine_id,
                    d_rank=self.me.rank,
                    d_tp_size=self.me.tp_size,
                    d_addr=self.me.addr,
                    layout=self.layout,
                    block_ids=exp.block_ids,
                    first_token=exp.first_token,
                    num_tokens=exp.num_tokens,
                    ttl_ms=min(left_ms, m.MAX_TTL_MS),
                    trace=exp.trace,
                    write_timeout_ms=min(
                        max(1, self.policy.write_timeout_ns // 1_000_000), m.MAX_TTL_MS
                    ),
                    p_pp_size=exp.p_pp_size if exp.p_pp_size > 1 else UNSET,
                )
            )

        self.peers.send(
            a.source.addr,
            frame,
            now_ns,
            self._on_send_error(a.transfer_id, a.source),
            sent=lambda: self.spans.register_sent(a.transfer_id),
        )

    def _on_send_error(self, tid: str, src: ev.Source) -> Callable[[TransportError], None]:
        def fail(exc: TransportError) -> None:
            # Undelivered: that rank never saw this message, or is gone. Either way it
            # will not write for this transfer.
            self.counters.add(Count.SEND_FAILED)
            logger.warning("Transfer %s: message to P rank %d failed: %s", tid, src.p_rank, exc)
            if isinstance(exc, PeerDisconnected):
                reason = m.FailReason.PEER_LOST
            elif isinstance(exc, NotSent):
                reason = m.FailReason.DEADLINE
            else:
                reason = m.FailReason.HANDSHAKE
            now = self._clock()
            self._run(self.table.handle(ev.SendFailed(tid, src.p_rank, reason), now), now)

        return fail

    def _offer_failed(self, agent: str) -> Callable[[TransportError], None]:
        def fail(exc: TransportError) -> None:
            self._offered.discard(agent)  # offer again with the next registration
            self._count_failure(exc)

        return fail

    def _count_failure(self, exc: TransportError) -> None:
        self.counters.add(Count.SEND_FAILED)
        logger.warning("Sending a notification from %s failed: %s", self.me.addr.agent, exc)

    def _on_heartbeat_error(self, addr: m.PeerAddr) -> Callable[[TransportError], None]:
        def fail(exc: TransportError) -> None:
            self.counters.add(Count.HEARTBEAT_FAILED)
            if isinstance(exc, PeerDisconnected):
                self._offered.discard(addr.agent)
                now = self._clock()
                self._run(self.table.handle(ev.PeerLost(addr.agent), now), now)

        return fail
