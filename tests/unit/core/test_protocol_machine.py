"""Stateful property test of the whole push protocol core (docs/protocol.md, "Invariants").

Over 400 lines, one job: one state machine, its simulated network and its invariants.

P ranks (SenderTable) and D ranks (ReceiverTable) talk through a simulated network that
reorders, duplicates and drops frames, encoded with the real codec, and loses any frame
older than MAX_DELAY_NS (a bounded one-way delay: D's grace covers it). Rules cover
registration, prefill done or aborted, WRITEs landing or failing, D aborts, a P rank
dying, and time passing. Invariants are checked as actions come out; liveness (every
handed-over block comes back, every expected transfer is reported) at teardown, after
the network is drained and time has run past every deadline.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from connector.core import events as ev
from connector.core import messages as m
from connector.core.heads import assign_writers, head_range, sources_of, targets_of
from connector.core.receiver_table import ReceiverTable
from connector.core.sender_table import SenderTable
from connector.core.state import ReceiverPolicy, SenderPolicy
from tests.unit.core.factories import LAYOUT, d_addr, p_addr

MS = 1_000_000
TIDS = ("t0", "t1", "t2")
HEADS = 4
SEND_POLICY = SenderPolicy(
    lease_ns=100 * MS,
    max_registration_ttl_ns=10_000 * MS,
    write_timeout_ns=50 * MS,
    tombstone_ns=500 * MS,
)
RECV_POLICY = ReceiverPolicy(
    timeout_ns=200 * MS,
    grace_ns=80 * MS,
    heartbeat_interval_ns=30 * MS,
    tombstone_ns=500 * MS,
    write_timeout_ns=40 * MS,  # shorter than P's own: P must honour D's bound
)
# The network's longest one-way delay: a frame older than this is lost instead. D's grace
# is its margin for it (docs/protocol.md, "Deadlines").
MAX_DELAY_NS = 70 * MS


def _rank(agent: str) -> int:
    return int(agent.rsplit("-", 1)[1])


class PushProtocol(RuleBasedStateMachine):
    @initialize(tp=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (1, 4)]))
    def setup(self, tp: tuple[int, int]) -> None:
        self.p_tp, self.d_tp = tp
        assign = assign_writers(
            [head_range(p, self.p_tp, HEADS) for p in range(self.p_tp)],
            [head_range(d, self.d_tp, HEADS) for d in range(self.d_tp)],
        )
        self.targets = {p: frozenset(targets_of(assign, p)) for p in range(self.p_tp)}
        self.sources = {d: sources_of(assign, d) for d in range(self.d_tp)}
        self.P = {
            p: SenderTable(lambda _d_tp, p=p: self.targets[p], SEND_POLICY)
            for p in range(self.p_tp)
        }
        self.D = {d: ReceiverTable(RECV_POLICY) for d in range(self.d_tp)}
        self.now = 0
        self.net: list[tuple[str, int, bytes, int]] = []  # (side, rank, frame, sent at)
        self.in_flight: dict[tuple[int, str], set[int]] = {}  # (p, tid) -> D ranks not landed
        self.landed: set[tuple[int, str, int]] = set()
        self.stuck: set[tuple[int, str]] = set()  # WRITEs that never finish on their own
        self.issued: Counter[tuple[int, str]] = Counter()
        self.freed: Counter[tuple[int, str]] = Counter()
        self.prefill_seen: set[tuple[int, str]] = set()
        self.handed_over: set[tuple[int, str]] = set()
        self.expected: set[tuple[int, str]] = set()
        self.reported: dict[tuple[int, str], ev.ReportReceived] = {}
        self.dead: set[int] = set()
        self.reclaimed: set[tuple[int, str]] = set()  # vLLM took these source blocks back
        self.closing: dict[str, set[int]] = {"P": set(), "D": set()}  # ranks shutting down
        note(f"P tp={self.p_tp} D tp={self.d_tp} targets={self.targets}")

    # ------------------------------------------------------------- action plumbing
    def _p_do(self, p: int, actions: list) -> None:
        for a in actions:
            note(f"P{p} -> {a}")
            if isinstance(a, ev.IssueWrite):
                key = (p, a.transfer_id)
                self.issued[key] += 1
                assert self.issued[key] == 1, f"second WRITE for {key}"
                assert self.freed[key] == 0, "WRITE from blocks already freed"
                assert key not in self.reclaimed, "WRITE from blocks vLLM reclaimed"
                self.in_flight[key] = {r.d_rank for r in a.registrations}
            elif isinstance(a, ev.FreeBlocks):
                key = (p, a.transfer_id)
                assert not self.in_flight.get(key), f"freed {key} under a live WRITE"
                if key in self.reclaimed:  # the scheduler side drops it: vLLM freed them
                    continue
                assert key in self.handed_over, f"freed {key} that was never handed over"
                self.freed[key] += 1
                assert self.freed[key] == 1, f"freed {key} twice"
            elif isinstance(a, ev.AbortWrite):
                # The transport releases the handle; what had not landed never will.
                self.in_flight.pop((p, a.transfer_id), None)
                self.stuck.discard((p, a.transfer_id))
                self._p_do(
                    p,
                    self.P[p].handle(
                        ev.WriteFailed(a.transfer_id, m.FailReason.WRITE_TIMEOUT), self.now
                    ),
                )
            elif isinstance(a, ev.SendFail):
                for addr in a.to:
                    self._send(
                        "D",
                        _rank(addr.agent),
                        m.encode(m.Fail(transfer_id=a.transfer_id, p_rank=p, reason=a.reason)),
                    )
            elif isinstance(a, ev.ResendCompletion):
                for addr in a.to:
                    self._send(
                        "D",
                        _rank(addr.agent),
                        m.encode(
                            m.Completion(transfer_id=a.transfer_id, p_rank=p, p_tp_size=self.p_tp)
                        ),
                    )
            else:
                raise AssertionError(f"unexpected P action {a}")

    def _d_do(self, d: int, actions: list) -> None:
        for a in actions:
            note(f"D{d} -> {a}")
            if isinstance(a, ev.SendRegister):
                p = a.source.p_rank
                if p in self.dead:  # send_notif to a dead agent raises: P never saw it
                    self._d_do(
                        d,
                        self.D[d].handle(
                            ev.SendFailed(a.transfer_id, p, m.FailReason.PEER_LOST), self.now
                        ),
                    )
                    continue
                rec = self.D[d].get(a.transfer_id)
                assert rec is not None
                left_ms = (rec.expires_ns - self.now) // MS  # as the Receiver computes it
                assert left_ms >= 1
                self._send(
                    "P",
                    p,
                    m.encode(
                        m.Register(
                            transfer_id=a.transfer_id,
                            d_engine_id="decode",
                            d_rank=d,
                            d_tp_size=self.d_tp,
                            d_addr=d_addr(d),
                            layout=LAYOUT,
                            block_ids=((1, 2),),
                            first_token=0,
                            num_tokens=32,
                            ttl_ms=left_ms,
                            write_timeout_ms=RECV_POLICY.write_timeout_ns // MS,
                        )
                    ),
                )
            elif isinstance(a, ev.SendCancel):
                for src in a.to:
                    self._send(
                        "P",
                        src.p_rank,
                        m.encode(
                            m.Cancel(
                                transfer_id=a.transfer_id,
                                d_rank=d,
                                d_addr=d_addr(d),
                                reason=a.reason,
                            )
                        ),
                    )
            elif isinstance(a, ev.SendHeartbeat):
                ids = a.transfer_ids
                self._send(
                    "P",
                    _rank(a.to.agent),
                    m.encode(
                        m.Heartbeat(
                            transfer_id=ids[0], more_ids=ids[1:], d_rank=d, d_addr=d_addr(d)
                        )
                    ),
                )
            elif isinstance(a, ev.ReportReceived):
                key = (d, a.transfer_id)
                assert key in self.expected, f"reported {key} never expected"
                assert key not in self.reported, f"reported {key} twice"
                self.reported[key] = a
                rec = self.D[d].get(a.transfer_id)
                assert rec is not None
                writers = [
                    p
                    for (p, tid), ds in self.in_flight.items()
                    if tid == a.transfer_id and d in ds and p not in self.dead
                ]
                # No exception for the last resort either: a silent source is given up only
                # once its WRITE deadline, known to D, has passed.
                assert not writers, f"D{d} released {a.transfer_id} while P{writers} may write"
                if a.ok:
                    missing = [
                        p for p in self.sources[d] if (p, a.transfer_id, d) not in self.landed
                    ]
                    assert not missing, f"reported ok but P{missing} never landed"
            else:
                raise AssertionError(f"unexpected D action {a}")

    def _send(self, side: str, rank: int, frame: bytes) -> None:
        self.net.append((side, rank, frame, self.now))

    def _deliver(self, side: str, rank: int, frame: bytes, sent_ns: int) -> None:
        msg = m.decode(frame)
        if self.now - sent_ns > MAX_DELAY_NS:
            note(f"lost (too old) to {side}{rank}: {type(msg).__name__} {msg.transfer_id}")
            return
        note(f"deliver to {side}{rank}: {type(msg).__name__} {msg.transfer_id}")
        if side == "P":
            if rank in self.dead:
                return
            if isinstance(msg, m.Register):
                self._p_do(rank, self.P[rank].handle(ev.Registered(msg), self.now))
            elif isinstance(msg, m.Cancel):
                self._p_do(
                    rank,
                    self.P[rank].handle(
                        ev.Cancelled(msg.transfer_id, msg.d_rank, msg.d_addr, msg.reason), self.now
                    ),
                )
            elif isinstance(msg, m.Heartbeat):
                for tid in msg.transfer_ids():
                    self._p_do(
                        rank, self.P[rank].handle(ev.HeartbeatSeen(tid, msg.d_addr), self.now)
                    )
        else:
            if isinstance(msg, m.Completion):
                self._d_do(
                    rank,
                    self.D[rank].handle(ev.CompletionSeen(msg.transfer_id, msg.p_rank), self.now),
                )
            elif isinstance(msg, m.Fail):
                self._d_do(
                    rank,
                    self.D[rank].handle(
                        ev.FailSeen(msg.transfer_id, msg.p_rank, msg.reason), self.now
                    ),
                )

    # ------------------------------------------------------------- engine rules
    @rule(data=st.data(), tid=st.sampled_from(TIDS), aborted=st.booleans())
    def prefill_finished(self, data: st.DataObject, tid: str, aborted: bool) -> None:
        live = [
            p for p in range(self.p_tp) if (p, tid) not in self.prefill_seen and p not in self.dead
        ]
        if not live:
            return
        p = data.draw(st.sampled_from(live))
        self.prefill_seen.add((p, tid))
        if aborted:
            self._p_do(p, self.P[p].handle(ev.PrefillAborted(tid, f"req-{tid}"), self.now))
        else:
            self.handed_over.add((p, tid))
            self._p_do(
                p, self.P[p].handle(ev.PrefillDone(tid, f"req-{tid}", ((3, 4),), 32), self.now)
            )

    @rule(data=st.data())
    def source_reclaimed(self, data: st.DataObject) -> None:
        live = sorted(
            k
            for k in self.handed_over
            if k not in self.reclaimed and self.freed[k] == 0 and k[0] not in self.dead
        )
        if not live:
            return
        p, tid = data.draw(st.sampled_from(live))
        # Preempted (prefill_aborted), or stopped with no D to follow (not_needed).
        reason = data.draw(st.sampled_from([m.FailReason.PREFILL_ABORTED, m.FailReason.NOT_NEEDED]))
        self.reclaimed.add((p, tid))
        self._p_do(p, self.P[p].handle(ev.SourceReclaimed(tid, reason), self.now))

    @rule(data=st.data(), tid=st.sampled_from(TIDS))
    def decode_allocated(self, data: st.DataObject, tid: str) -> None:
        fresh = [d for d in range(self.d_tp) if (d, tid) not in self.expected]
        if not fresh:
            return
        d = data.draw(st.sampled_from(fresh))
        self.expected.add((d, tid))
        srcs = tuple(ev.Source(p, p_addr(p)) for p in self.sources[d])
        self._d_do(
            d, self.D[d].handle(ev.Expected(tid, f"dreq-{tid}", srcs, ((1, 2),), 0, 32), self.now)
        )

    @rule(data=st.data())
    def decode_aborted(self, data: st.DataObject) -> None:
        if self.expected:
            d, tid = data.draw(st.sampled_from(sorted(self.expected)))
            self._d_do(d, self.D[d].handle(ev.AbortRequested(tid), self.now))

    @rule(data=st.data(), side=st.sampled_from(["P", "D"]))
    def rank_shuts_down(self, data: st.DataObject, side: str) -> None:
        """The engine's shutdown began (connector/shutdown.py): from now on each of the
        rank's polls ends what still waits (TransferThread._shut_down)."""
        n = self.p_tp if side == "P" else self.d_tp
        rank = data.draw(st.sampled_from(range(n)))
        if side == "P" and rank in self.dead:
            return
        self.closing[side].add(rank)
        self._shut_down()

    @precondition(lambda self: any(self.in_flight.values()))
    @rule(data=st.data())
    def writing_p_shuts_down(self, data: st.DataObject) -> None:
        """As above, for a P rank with a WRITE in flight: the WRITE must run on."""
        live = sorted({p for (p, _), ds in self.in_flight.items() if ds and p not in self.dead})
        if live:
            self.closing["P"].add(data.draw(st.sampled_from(live)))
            self._shut_down()

    def _shut_down(self) -> None:
        for p in sorted(self.closing["P"] - self.dead):
            self._p_do(p, self.P[p].shut_down(self.now))
        for d in sorted(self.closing["D"]):
            self._d_do(d, self.D[d].shut_down(self.now))

    # ------------------------------------------------------------- transport rules
    @precondition(lambda self: any(self.in_flight.values()))
    @rule(data=st.data())
    def write_lands(self, data: st.DataObject) -> None:
        live = sorted(
            (k, d)
            for k, ds in self.in_flight.items()
            for d in ds
            if k[0] not in self.dead and k not in self.stuck
        )
        if not live:
            return
        (p, tid), d = data.draw(st.sampled_from(live))
        self.in_flight[(p, tid)].discard(d)
        self.landed.add((p, tid, d))
        self._send("D", d, m.encode(m.Completion(transfer_id=tid, p_rank=p, p_tp_size=self.p_tp)))
        if not self.in_flight[(p, tid)]:
            del self.in_flight[(p, tid)]
            self._p_do(p, self.P[p].handle(ev.WriteDone(tid), self.now))

    @precondition(lambda self: any(self.in_flight.values()))
    @rule(data=st.data())
    def write_fails(self, data: st.DataObject) -> None:
        live = sorted(
            k
            for k, ds in self.in_flight.items()
            if ds and k[0] not in self.dead and k not in self.stuck
        )
        if not live:
            return
        p, tid = data.draw(st.sampled_from(live))
        del self.in_flight[(p, tid)]
        self._p_do(p, self.P[p].handle(ev.WriteFailed(tid, m.FailReason.WRITE_ERROR), self.now))

    @precondition(lambda self: any(self.in_flight.values()))
    @rule(data=st.data())
    def write_hangs(self, data: st.DataObject) -> None:
        self.stuck.add(
            data.draw(st.sampled_from(sorted(k for k, ds in self.in_flight.items() if ds)))
        )

    @precondition(lambda self: len(self.dead) < self.p_tp)
    @rule(data=st.data())
    def p_rank_dies(self, data: st.DataObject) -> None:
        p = data.draw(st.sampled_from([p for p in range(self.p_tp) if p not in self.dead]))
        self.dead.add(p)
        for key in [k for k in self.in_flight if k[0] == p]:
            del self.in_flight[key]  # a dead process's WRITEs never land
        for d in range(self.d_tp):
            self._d_do(d, self.D[d].handle(ev.PeerLost(p_addr(p).agent), self.now))

    # ------------------------------------------------------------- network rules
    @precondition(lambda self: self.net)
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.net) - 1))
        self._deliver(*self.net.pop(i))

    @precondition(lambda self: self.net)
    @rule(data=st.data())
    def duplicate(self, data: st.DataObject) -> None:
        self.net.append(self.net[data.draw(st.integers(0, len(self.net) - 1))])

    @precondition(lambda self: self.net)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        note(f"drop {self.net.pop(data.draw(st.integers(0, len(self.net) - 1)))[:2]}")

    @rule(dt_ms=st.sampled_from([1, 10, 40, 90, 250]))
    def time_passes(self, dt_ms: int) -> None:
        self._advance(dt_ms)

    def _advance(self, dt_ms: int) -> None:
        self.now += dt_ms * MS
        for p, table in self.P.items():
            if p not in self.dead:
                self._p_do(p, table.tick(self.now))
        for d, table in self.D.items():
            self._d_do(d, table.tick(self.now))
        self._shut_down()

    # ------------------------------------------------------------- invariants
    @invariant()
    def counters_are_sane(self) -> None:
        if not hasattr(self, "P"):
            return
        assert all(n <= 1 for n in self.issued.values())
        assert all(n <= 1 for n in self.freed.values())

    @invariant()
    def census_matches_the_records(self) -> None:
        """The tables' O(1) census (metrics) equals a scan of their records."""
        if not hasattr(self, "P"):
            return
        for table in (*self.P.values(), *self.D.values()):
            recs = list(table._records.values())
            scan = Counter(r.state for r in recs if not r.state.terminal)
            assert +table.live == scan, (table.live, scan)
            assert all(n >= 0 for n in table.live.values())
            assert sum(table.ended.values()) >= sum(1 for r in recs if r.state.terminal)
        for table in self.P.values():
            held = [r for r in table._records.values() if r.blocks_held]
            assert table.holding_blocks() == len(held)
            blocks, age = table.held(self.now)
            assert blocks == sum(len(g) for r in held for g in r.block_ids)
            assert (age > 0) <= bool(held) and age >= 0

    def teardown(self) -> None:
        if not hasattr(self, "P"):
            return
        # Liveness: a healthy network (no more drops), writes that finish, time that passes.
        for _ in range(100):
            while self.net:
                self._deliver(*self.net.pop(0))
            for p, tid in [k for k in self.in_flight if k not in self.stuck]:
                for d in sorted(self.in_flight.get((p, tid), ())):
                    self.in_flight[(p, tid)].discard(d)
                    self.landed.add((p, tid, d))
                    self._send(
                        "D",
                        d,
                        m.encode(m.Completion(transfer_id=tid, p_rank=p, p_tp_size=self.p_tp)),
                    )
                if not self.in_flight.get((p, tid)):
                    self.in_flight.pop((p, tid), None)
                    self._p_do(p, self.P[p].handle(ev.WriteDone(tid), self.now))
            self._advance(100)
            if (
                not self.net
                and not self.in_flight
                and all(len(t) == 0 for t in (*self.P.values(), *self.D.values()))
            ):
                break
        owed = [
            k
            for k in self.handed_over
            if k[0] not in self.dead and k not in self.reclaimed and self.freed[k] != 1
        ]
        assert not owed, f"blocks never given back: {owed}"
        unreported = [k for k in self.expected if k not in self.reported]
        assert not unreported, f"transfers never reported: {unreported}"
        for p, table in self.P.items():
            if p not in self.dead:
                assert table.holding_blocks() == 0


TestPushProtocol = PushProtocol.TestCase
TestPushProtocol.settings = settings(
    max_examples=400,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
