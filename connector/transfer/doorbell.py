"""Doorbells: UDP wake-ups between transfer threads, so a thread that waits on its peer
can sleep instead of polling NIXL every millisecond.

With NIXL's progress thread off (on a small host it busy-polls a core), a notification
is only seen when our thread calls into NIXL, and every poll costs a wake-up on the core
where D's decode steps run. A peer that sends us a notification (D its registration, P a
WRITE's completion: NIXL sends it when P sees the WRITE DONE) or posts a WRITE into us (P)
also sends one UDP datagram to our listen port number; our thread, asleep in ``wait``,
wakes and polls NIXL at once, and after a WRITE bell keeps polling
(``connector.transfer.polling``) until that WRITE's completion is in (it may need our UCX
progress). A bell is only a hint: it moves no data and decides nothing; a forged one
costs polls for at most ``IncomingWrites.max_wait_s`` (with the P/D secret, rings are
sealed by ``Guard`` and a forged one is ignored and counted as ``refused``). The
thread still polls while it waits on a peer: every ``poll_bell_fallback_s`` while a peer
it waits on has never rung it (a peer without doorbells, or one not heard from yet, is
only slower), and every ``poll_bell_trusted_s`` once each has (only a dropped datagram
waits that long).
``heard_from`` says who has rung: the datagram's source address is the ringer's doorbell,
bound to its transport's host and port, so it matches the peer's ``PeerAddr``. What the
doorbells save: ``python -m bench.poll_cost`` against ``--no-doorbell``.

Owns: the UDP socket (bound to the transport's host and listen port number: TCP and UDP
ports are separate, so the peer needs no new address), the local wake-up of the engine
side (``wake``, thread-safe), the counters, and ``IncomingWrites`` (which announced WRITEs
are still in flight; pure). Used only by ``TransferThread`` (``wait``, ``wake``) and
``Peers`` (``ring``).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

from connector.transfer.guard import Guard
from telemetry.counts import Counts
from telemetry.schema import Count

logger = logging.getLogger(__name__)

# What a ring says (anything else counts as MESSAGE):
MESSAGE = b"M"  # I sent you a notification: look now
WRITE = b"W"  # + "<p_rank>:<transfer_id>": I posted that WRITE into you; keep polling (it may
#               need your UCX progress) until its completion notification is in
DONE = b"D"  # + the same key: that WRITE is DONE and its completion sent: look now, unless
#              you have it already (a steady poll often took it in before this ring came)
_LOCAL = b"L"
MAX_RINGERS = 4096  # doorbells remembered as ringing (peers of one instance: a few dozen)


def write_key(p_rank: int, transfer_id: str) -> bytes:
    """Names one P rank's WRITE of a transfer, in its bell and at its completion."""
    return f"{p_rank}:{transfer_id}".encode()


@dataclass
class Rings:
    """What ended a ``wait``: ``woken`` (anything, a local wake-up included), and the
    peers' rings among it: "look now" ``messages``, and the ``write_key`` of each WRITE
    announced (``writes``) or DONE (``dones``)."""

    woken: bool
    messages: int = 0
    writes: list[bytes] = field(default_factory=list)
    dones: list[bytes] = field(default_factory=list)

    @property
    def rings(self) -> int:
        return self.messages + len(self.writes) + len(self.dones)


class Doorbell:
    def __init__(self, host: str, port: int, guard: Guard | None = None) -> None:
        # With a secret, rings are sealed and unsealed ones ignored (a forged ring costs
        # nothing then; without one it costs polls, bounded as above).
        self._guard = guard if guard is not None else Guard()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._udp = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self._udp.bind((host, port))
        except OSError:
            self._udp.close()
            raise
        self._udp.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # select(2), not epoll: epoll's timeout is whole milliseconds, and a WRITE in
        # flight is first polled after far less (Backoff.hot_min_s).
        self._socks = [self._udp, self._wake_r]
        self._heard_from: set[tuple[str, int]] = set()  # doorbells that rang us
        self.counters: Counts = Counts()

    @classmethod
    def open(cls, host: str, port: int, guard: Guard | None = None) -> Doorbell | None:
        """A doorbell on ``host:port``, or None (logged) if that UDP port is taken: the
        thread then polls as before."""
        try:
            return cls(host, port, guard)
        except OSError as exc:
            logger.warning(
                "No doorbell on udp %s:%d (%s); polling every millisecond instead", host, port, exc
            )
            return None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._udp.getsockname()[:2]
        return str(host), int(port)

    def ring(self, host: str, port: int, what: bytes = MESSAGE) -> None:
        """Wake the transfer thread listening on ``host:port`` (fire and forget)."""
        try:
            self._udp.sendto(self._guard.seal_bell(what), (host, port))
            self.counters.add(Count.RUNG)
        except OSError:  # full buffer, no route: the peer's fallback poll still runs
            self.counters.add(Count.RING_FAILED)

    def wake(self) -> None:
        """Wake our own thread (from any thread: the engine's submit, stop)."""
        # Full: a wake-up is already pending; closed: the thread has stopped. Nothing to wake.
        with contextlib.suppress(OSError):
            self._wake_w.send(_LOCAL)

    def wait(self, timeout_s: float) -> Rings:
        """Sleep until a bell, a local wake-up or ``timeout_s``; what woke it. Drains every
        pending wake-up, so one wait answers all bells rung before it."""
        try:
            ready, _, _ = select.select(self._socks, [], [], timeout_s)
        except InterruptedError:
            return Rings(False)
        out = Rings(bool(ready))
        for sock in ready:
            while True:
                try:
                    data, source = sock.recvfrom(512)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:  # e.g. ICMP port unreachable reported on our socket
                    break
                if not data:
                    break
                if sock is self._udp:
                    opened = self._guard.open_bell(data)
                    if opened is None:
                        self.counters.add(Count.REFUSED)
                        continue
                    data = opened
                    self._note_ringer(source)
                    kind = data[:1]
                    if kind == WRITE:
                        out.writes.append(data[1:])
                    elif kind == DONE:
                        out.dones.append(data[1:])
                    else:
                        out.messages += 1
        if out.rings:
            self.counters.add(Count.HEARD, n=out.rings)
            self.counters.add(Count.HEARD_WRITE, n=len(out.writes))
            self.counters.add(Count.HEARD_DONE, n=len(out.dones))
        return out

    def heard_from(self, host: str, port: int) -> bool:
        """Has the doorbell at ``host:port`` rung us (so that peer rings with its news)?"""
        return (host, port) in self._heard_from

    def _note_ringer(self, source: object) -> None:
        if not isinstance(source, tuple) or len(self._heard_from) >= MAX_RINGERS:
            return  # a flood of forged sources: those peers keep the short fallback poll
        self._heard_from.add((str(source[0]), int(source[1])))

    def close(self) -> None:
        for s in (self._udp, self._wake_r, self._wake_w):
            s.close()


class IncomingWrites:
    """Peers' WRITEs into us (``write_key``) that a bell announced and whose completion has
    not come: the thread keeps polling (every ``poll_incoming_s``) while any is ``pending``,
    but no longer than ``max_wait_s`` after its bell (a peer that died mid-WRITE, a forged
    bell). A completion can beat its bell (the two travel apart): every completion is
    remembered as landed for ``max_wait_s``, so a late WRITE bell starts no wait and a DONE
    bell that comes after its completion no fast polls. Pure: the clock is an argument."""

    def __init__(self, max_wait_s: float = 0.05, max_tracked: int = 4096) -> None:
        self.counters = Counts()  # merged into the thread's when it stops
        self.max_wait_s, self.max_tracked = max_wait_s, max_tracked
        self._until: dict[bytes, float] = {}  # announced, not landed: key -> give up at
        self._landed: dict[bytes, float] = {}  # landed before its bell: key -> when

    def announced(self, keys: Iterable[bytes], now_s: float) -> None:
        for key in keys:
            if key in self._landed:
                continue  # its completion is in already
            if len(self._until) >= self.max_tracked:  # a flood of forged bells
                self.counters.add(Count.INCOMING_DROPPED)
                continue
            self._until[key] = now_s + self.max_wait_s

    def landed(self, key: bytes, now_s: float) -> None:
        self._until.pop(key, None)
        if len(self._landed) < self.max_tracked:
            self._landed[key] = now_s  # a late WRITE or DONE bell then starts nothing

    def done_rung(self, key: bytes) -> bool:
        """A DONE bell: is its completion still to come (worth fast polls)?"""
        return key not in self._landed

    def pending(self, now_s: float) -> bool:
        """Any announced WRITE still in flight (forgets those past ``max_wait_s``)."""
        if self._until:
            for key in [k for k, until in self._until.items() if until <= now_s]:
                del self._until[key]
                self.counters.add(Count.INCOMING_EXPIRED)
        if self._landed:
            for key in [k for k, t in self._landed.items() if t + self.max_wait_s <= now_s]:
                del self._landed[key]
        return bool(self._until)
