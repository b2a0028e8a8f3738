"""The transfer thread: the only thread that touches the transport.

Owns: the loop that drains engine commands, reads notifications, drives the endpoints
(P's ``Sender``, D's ``Receiver``, or both) and hands outcomes back. The engine talks to
it only through ``submit`` and ``take_*`` (thread-safe), so the protocol core is never
entered from two threads and nothing of the transfer runs on the engine's loop.

Polling, not blocking: with NIXL's progress thread off, UCX progresses only inside our
calls. How often the loop polls (fast for local work, steadily for a peer's WRITE into
us, rarely while it only waits on a peer that rings its doorbell, ``connector.transfer.doorbell``)
is ``connector.transfer.polling.Backoff``'s; a submit wakes it at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from connector.config import PushkvConfig
from connector.core import events as ev
from connector.core import messages as m
from connector.core.errors import PushkvError, RemoteProtocolError, TransportError
from connector.transfer.doorbell import Doorbell, IncomingWrites, write_key
from connector.transfer.guard import Guard
from connector.transfer.handback import Handback
from connector.transfer.metrics import RankMetrics
from connector.transfer.peers import Peers
from connector.transfer.polling import Backoff
from connector.transfer.receiver import Received, Receiver
from connector.transfer.sender import Sender
from connector.transfer.thread_os import EventWaker, Waker, name_os_thread, unpin
from connector.transport.base import Transport
from telemetry.counts import Counts
from telemetry.schema import Count

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Reclaim:
    transfer_ids: list[str]
    done: threading.Event
    reason: m.FailReason


@dataclass(frozen=True)
class _Close:
    """Shut down ``grace_ns`` from now (``begin_shutdown``, ``drain``); ``done`` is set once
    nothing is left to finish or hand back."""

    grace_ns: int
    done: threading.Event | None = None


class TransferThread:
    def __init__(
        self,
        transport: Transport,
        peers: Peers,
        *,
        sender: Sender | None = None,
        receiver: Receiver | None = None,
        name: str = "pushkv-transfer",
        bell: Doorbell | None = None,
        backoff: Backoff | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        guard: Guard | None = None,
        metrics: RankMetrics | None = None,
    ) -> None:
        """``backoff``: the polling policy (default: ``PushkvConfig``'s defaults for
        this ``bell``, as ``Backoff.from_config`` builds it). ``guard``: opens incoming
        notifications (refuses unauthenticated ones when it holds a secret). ``metrics``:
        where this thread publishes its census for vLLM's /metrics
        (``connector.transfer.metrics``)."""
        self.guard = guard if guard is not None else Guard()
        if sender is None and receiver is None:
            raise ValueError("a transfer thread needs a sender, a receiver or both")
        self._t, self._peers, self.sender, self.receiver = transport, peers, sender, receiver
        if backoff is None:
            backoff = Backoff.from_config(PushkvConfig(), doorbell=bell is not None)
        self._backoff = backoff
        self._clock = clock
        self._inbox: queue.SimpleQueue[tuple[Any, Any, Any]] = queue.SimpleQueue()
        self._bell = bell
        self._wake: Waker = bell if bell is not None else EventWaker()
        self._stop = threading.Event()
        self._results = Handback()
        self._pending_push = 0
        self._quiesce: list[tuple[list[str], threading.Event]] = []
        self._closing_at: int | None = None  # from then on: shutting down (our clock)
        # When we last read the transport: what the next read returns arrived after it.
        self._read_ns: int | None = None
        self._closed = False  # _closing_at has passed: each poll ends what waits
        self._drained: list[threading.Event] = []
        self.counters: Counts = Counts()
        self.metrics = metrics
        self._incoming = IncomingWrites() if bell is not None else None
        if sender is not None and sender.paths is not None:
            sender.paths.bind_waker(self._wake.wake)  # a GPU copy's end wakes us at once
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ------------------------------------------------------------------ engine side
    def start(self) -> None:
        self._thread.start()

    def submit(self, event: Any, ready: Callable[[], bool] | None = None, note: Any = None) -> None:
        """Hand an engine event (PrefillDone, PrefillAborted, Expected, AbortRequested) over.
        ``ready``: for PrefillDone on GPU, says when the KV is computed (a CUDA event).
        ``note``: the engine's timestamps for the event's spans (``connector.transfer.spans``)."""
        self._inbox.put((event, ready, note))
        self._wake.wake()

    def reclaim(
        self,
        transfer_ids: list[str],
        timeout_s: float,
        reason: m.FailReason = m.FailReason.PREFILL_ABORTED,
    ) -> bool:
        """P: vLLM took these transfers' source blocks back. Block until no WRITE reads
        them (so the caller's next forward cannot overwrite what a WRITE still reads);
        False if that took longer than ``timeout_s``. ``reason``: how a transfer still
        waiting for D ends."""
        done = threading.Event()
        self._inbox.put((_Reclaim(list(transfer_ids), done, reason), None, None))
        self._wake.wake()
        return done.wait(timeout_s)

    def begin_shutdown(self, grace_s: float) -> None:
        """The engine is shutting down (vLLM drains its requests before it exits): WRITEs
        posted or ready run to their end; ``grace_s`` from now, every transfer still waiting
        (P: for D's registration or its prefill; D: for its KV) ends with reason
        ``shutdown``, its peer told at once, and so does each one that comes later."""
        self._inbox.put((_Close(max(0, int(grace_s * 1e9))), None, None))
        self._wake.wake()

    def drain(self, timeout_s: float) -> bool:
        """Before ``stop``: end every waiting transfer now (as ``begin_shutdown`` does),
        and block until the WRITEs in flight have ended and every peer has answered D's
        cancels, or ``timeout_s`` passed (False)."""
        if not self._thread.is_alive():
            return True
        done = threading.Event()
        self._inbox.put((_Close(0, done), None, None))
        self._wake.wake()
        return done.wait(timeout_s)

    @property
    def closing(self) -> bool:
        return self._closing_at is not None

    def take_finished_sending(self) -> list[str]:
        return self._results.take_sent()

    def take_finished_recving(self) -> list[Received]:
        return self._results.take_recvd()

    def wait_for_results(self, timeout_s: float) -> bool:
        """Block until a transfer result is ready to take (True) or ``timeout_s`` passed.
        For an engine step with nothing else to do (see ``PushkvConfig.idle_step_wait_s``);
        counted here, from the engine's thread."""
        got = self._results.wait(timeout_s)
        self.counters.add(Count.IDLE_STEP_WAITS)
        self.counters.add(Count.IDLE_STEP_WAIT_RESULTS if got else Count.IDLE_STEP_WAIT_TIMEOUTS)
        return got

    @property
    def transfers_pending(self) -> bool:
        """A result may come: D awaits KV, or P holds blocks it has not handed back."""
        return (
            self._pending_push > 0
            or not self._inbox.empty()
            or (self.receiver is not None and self.receiver.busy())
        )

    @property
    def pending_push_work(self) -> bool:
        """P still holds blocks it owes the scheduler (has_pending_push_work)."""
        return self._pending_push > 0 or not self._inbox.empty()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.wake()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error(
                    "Transfer thread %s did not stop within %.1fs", self._thread.name, timeout_s
                )
                return  # still inside wait(): leave the bell's sockets to the process
        for endpoint in (self.sender, self.receiver):  # their fault counters (schema.Count)
            if endpoint is not None:
                self.counters.merge(endpoint.counters)
        self.counters.merge(self._peers.counters)  # peers gone, unreachable, backed off
        if self._incoming is not None:
            self.counters.merge(self._incoming.counters)
        self.counters.merge(self._t.counters)  # the transport's own (NIXL: metadata loads)
        if self._bell is not None:
            self.counters.merge(self._bell.counters, prefix=Count.BELL)
            self._bell.close()
            self._bell = None

    @property
    def bell(self) -> Doorbell | None:
        return self._bell

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        name_os_thread(self._thread.name)
        unpin()
        woken, rung = False, False
        while not self._stop.is_set():
            self.counters.add(Count.POLLS)
            try:
                active = self._step()
            except Exception:  # never let one bad iteration kill the thread
                self.counters.add(Count.LOOP_ERRORS)
                logger.exception("Transfer thread iteration failed; continuing")
                active = False
            now_s = self._clock() / 1e9
            incoming = self._incoming is not None and self._incoming.pending(now_s)
            remote = self._remote_busy()
            delay = self._backoff.next(
                now_s,
                active=active,
                woken=woken,
                rung=rung,
                local=self._local_busy(),
                remote=remote,
                incoming=incoming,
                trusted=remote and self._peers_ring(),
            )
            rings = self._wake.wait(self._until_due(delay))
            woken, rung = rings.woken, rings.messages > 0
            if self._incoming is not None and (rings.writes or rings.dones):
                self._incoming.announced(rings.writes, self._clock() / 1e9)
                # A WRITE bell announces work (incoming), not news; a DONE bell is news
                # unless its completion is in already.
                rung = rung or any(self._incoming.done_rung(k) for k in rings.dones)

    def _until_due(self, delay_s: float) -> float:
        """``delay_s``, but no sleep past the next deadline the tables (leases, deadlines,
        heartbeats, tombstones) or the path driver keep: an idle thread sleeps long
        (``poll_idle_bell_s``), and each of them must still fire on time. Never below
        ``hot_max_s``, so a deadline that stays due cannot spin the thread."""
        s, r = self.sender, self.receiver
        due = [
            d
            for d in (
                s.table.next_deadline_ns() if s is not None else None,
                r.table.next_deadline_ns() if r is not None else None,
                s.paths.due_ns() if s is not None and s.paths is not None else None,
                self._closing_at if self._closing_at is not None and not self._closed else None,
            )
            if d is not None
        ]
        if not due:
            return delay_s
        left_s = (min(due) - self._clock()) / 1e9
        return min(delay_s, max(left_s, self._backoff.hot_max_s))

    def _local_busy(self) -> bool:
        """Work of ours that needs UCX progress to finish: a dial, a WRITE in flight."""
        return self._peers.dialing or (self.sender is not None and self.sender.writing())

    def _remote_busy(self) -> bool:
        """Waiting on a peer: P for a registration, D for its KV."""
        return (self.sender is not None and self.sender.awaiting_network()) or (
            self.receiver is not None and self.receiver.busy()
        )

    def _peers_ring(self) -> bool:
        """Every peer we wait on has rung us before, so its news will ring too. Only D
        knows whom it waits on (P waits for registrations from any D)."""
        bell = self._bell
        if bell is None or self.receiver is None:
            return False
        if self.sender is not None and self.sender.awaiting_network():
            return False
        return all(bell.heard_from(host, port) for host, port in self.receiver.awaited_addrs())

    def _step(self) -> bool:
        """One iteration; True if anything happened (keep polling fast)."""
        now = self._clock()
        active = False
        while True:
            try:
                event, ready, note = self._inbox.get_nowait()
            except queue.Empty:
                break
            active = True
            self._dispatch_event(event, ready, note, now)
        # What this read returns arrived after the previous one began: a registration read
        # late because we did not run (stopped) counts its ttl from there (send_state.py).
        since, self._read_ns = self._read_ns, self._clock()
        try:
            notifs = self._t.get_notifs()
        except TransportError as exc:
            self.counters.add(Count.GET_NOTIFS_FAILED)
            logger.warning("Reading notifications failed: %s", exc)
            notifs = []
        now = self._clock()  # after the read: time we were stopped inside it counts
        for agent, frame in notifs:
            active = True
            self._dispatch_frame(agent, frame, now, since)
        self._peers.poll(now)
        if self.sender is not None:
            self.sender.poll(now)
        if self.receiver is not None:
            self.receiver.poll(now)
        if self._closing_at is not None and now >= self._closing_at:
            self._closed = True
            self._shut_down(now)
        if self._quiesce and self.sender is not None:
            still = []
            for tids, done in self._quiesce:
                (done.set() if self.sender.quiescent(tids) else still.append((tids, done)))
            self._quiesce = still
        self._publish()
        return active

    def _shut_down(self, now: int) -> None:
        """Each poll once shutting down: end what waits (including what arrived since);
        wake ``drain`` once nothing is left in flight."""
        s, r = self.sender, self.receiver
        if s is not None:
            s.shut_down(now)
        if r is not None:
            r.shut_down(now)
        if self._drained and self._settled():
            for done in self._drained:
                done.set()
            self._drained = []

    def _settled(self) -> bool:
        s, r = self.sender, self.receiver
        return (
            (s is None or (s.table.settled() and not s.writing()))
            and (r is None or not r.busy())
            and not self._peers.dialing
        )

    def _dispatch_event(
        self, event: Any, ready: Callable[[], bool] | None, note: Any, now: int
    ) -> None:
        if isinstance(event, _Close):
            at = now + event.grace_ns
            if self._closing_at is None:
                logger.info(
                    "Transfer thread %s shutting down in %.1f s: transfers still waiting "
                    "then end with reason shutdown",
                    self._thread.name,
                    event.grace_ns / 1e9,
                )
            self._closing_at = at if self._closing_at is None else min(self._closing_at, at)
            if event.done is not None:
                self._drained.append(event.done)
            return
        if isinstance(event, _Reclaim):
            if self.sender is None:
                event.done.set()
                return
            for tid in event.transfer_ids:
                self.sender.on_event(ev.SourceReclaimed(tid, event.reason), now)
            if self.metrics is not None:  # a transfer may have ended with no result to
                # report, and the engine's step that waits on this may be its last for a while
                self.metrics.publish(self, self._clock(), force=True)
            self._quiesce.append((event.transfer_ids, event.done))
            return
        try:
            if isinstance(event, (ev.PrefillDone, ev.PrefillAborted)) and self.sender is not None:
                self.sender.on_event(event, now, ready, note)
            elif (
                isinstance(event, (ev.Expected, ev.AbortRequested, ev.NotNeeded))
                and self.receiver is not None
            ):
                self.receiver.on_event(event, now, note=note)
            else:
                raise TypeError(f"no endpoint takes {type(event).__name__}")
        except PushkvError:
            # Our bug (LocalProtocolError) or a layout we cannot serve: log it once with
            # the transfer id; the transfer's deadline still ends it definitely.
            self.counters.add(Count.EVENT_ERRORS)
            logger.exception("Handling %s failed", event)

    def _dispatch_frame(self, agent: str, frame: bytes, now: int, since: int | None = None) -> None:
        if not m.is_frame(frame):
            self.counters.add(Count.FOREIGN_NOTIFS)
            return
        try:
            msg = self.guard.decode(frame, agent)
        except RemoteProtocolError as exc:
            self._drop(Count.MALFORMED_NOTIFS, "Dropped a notification from %s: %s", agent, exc)
            return
        if msg is None:  # failed authentication: counted by the guard
            self.counters.add(Count.UNAUTHENTICATED_NOTIFS)
            return
        if isinstance(msg, (m.Register, m.Cancel, m.Heartbeat, m.IpcOffer)):
            if self.sender is None:
                self.counters.add(Count.MISROUTED_NOTIFS)
                return
            self.sender.on_message(agent, msg, now, since)
            return
        if isinstance(msg, (m.Completion, m.Fail)) and self._incoming is not None:
            self._incoming.landed(write_key(msg.p_rank, msg.transfer_id), now / 1e9)
        if self.receiver is None:
            self.counters.add(Count.MISROUTED_NOTIFS)
            return
        self.receiver.on_message(agent, msg, now)

    def _drop(self, counter: Count, fmt: str, *args: Any) -> None:
        """Count a dropped message; log the 1st, 2nd, 4th, 8th... so a flood stays quiet."""
        self.counters.add(counter)
        n = self.counters.of(counter)
        if n & (n - 1) == 0:
            logger.warning(fmt + " (%d so far)", *args, n)

    def _publish(self) -> None:
        s, r = self.sender, self.receiver
        if self.metrics is not None:  # before the results, so their step sees these figures
            results = bool((s is not None and s.finished) or (r is not None and r.finished))
            self.metrics.publish(self, self._clock(), force=results)
        if (s is None or not s.finished) and (r is None or not r.finished):
            if s is not None:
                self._pending_push = s.table.holding_blocks()
            return
        self._results.put(s.finished if s is not None else [], r.finished if r is not None else [])
        if r is not None:
            r.finished = []
        if s is not None:
            s.finished = []
            self._pending_push = s.table.holding_blocks()
