"""Reaching peers: dial on first use, queue work until the peer's metadata is loaded, and
never let one peer's silence or death delay the work for another.

Owns: per-peer dial deadlines, the callbacks waiting on each peer, each peer's address and
ringing its doorbell (``connector.transfer.doorbell``) after we sent it something, and
per-peer backoff: a peer known to be gone (its side channel refused us, or the transport
saw it disconnect) or unreachable (no metadata by the dial deadline) fails what is sent to
it at once, without a dial, until its backoff has passed (doubling per failure in a row,
from ``backoff_min_ns`` to ``backoff_max_ns``; reset when it answers). Used only from the
transfer thread. Knows the Transport protocol, not NIXL.

Nothing here blocks: a dial is the transport's background exchange (the side channel's
dial workers, with a short connect timeout), and each loop iteration only asks whether it
has ended. A refused connection is an answer: what waits on that peer fails at the next
poll with ``PeerGone`` (the transfer's reason: ``peer_lost``), not at the dial deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from connector.core.errors import PeerDisconnected, PeerGone, PeerUnreachable, TransportError
from connector.core.messages import PeerAddr
from connector.transfer.doorbell import MESSAGE, Doorbell
from connector.transport.base import Transport
from telemetry.counts import Counts
from telemetry.schema import Count

logger = logging.getLogger(__name__)

OnReady = Callable[[], None]
OnFail = Callable[[TransportError], None]

BACKOFF_MIN_NS = 250_000_000
BACKOFF_MAX_NS = 5_000_000_000
_PRUNE_AT = 256  # down records kept before expired ones are dropped


class NotSent(TransportError):
    """A message that was no longer worth sending when its peer became reachable."""


@dataclass
class _Dial:
    addr: PeerAddr
    deadline_ns: int
    waiting: list[tuple[OnReady, OnFail]] = field(default_factory=list)


@dataclass
class _Down:
    """A peer that failed us: what its users get until ``until_ns``, and the next delay."""

    err: TransportError
    until_ns: int
    delay_ns: int


class Peers:
    """Run callbacks once a peer is reachable, or fail them when it is gone, its dial times
    out, or it is backing off from such a failure."""

    def __init__(
        self,
        transport: Transport,
        dial_timeout_ns: int = 5_000_000_000,
        bell: Doorbell | None = None,
        *,
        backoff_min_ns: int = BACKOFF_MIN_NS,
        backoff_max_ns: int = BACKOFF_MAX_NS,
    ) -> None:
        self._t = transport
        self._dial_timeout_ns = dial_timeout_ns
        self._dials: dict[str, _Dial] = {}
        self._addrs: dict[str, PeerAddr] = {}  # every peer we dealt with: where to ring
        self._down: dict[str, _Down] = {}
        self._backoff = (backoff_min_ns, max(backoff_min_ns, backoff_max_ns))
        self._now_ns = 0  # the latest time the loop gave us (for ``lost``, which has none)
        self._bell = bell
        self.counters: Counts = Counts()

    def ring(self, agent: str, what: bytes = MESSAGE) -> None:
        """Wake ``agent``'s transfer thread: we just sent it something, or posted a WRITE."""
        addr = self._addrs.get(agent)
        if self._bell is not None and addr is not None:
            self._bell.ring(addr.host, addr.port, what)

    def when_ready(self, addr: PeerAddr, now_ns: int, ready: OnReady, fail: OnFail) -> None:
        """Call ``ready`` now if the peer is loaded, else once it is; ``fail`` when it is
        gone, unreachable, or backing off from that (then at once)."""
        self._now_ns = max(self._now_ns, now_ns)
        agent = addr.agent
        self._addrs[agent] = addr
        dial = self._dials.get(agent)
        if dial is None:
            if self._t.peer_ready(agent):  # loaded: it answered (or dialed us) since
                self._down.pop(agent, None)
                ready()
                return
            down = self._down.get(agent)
            if down is not None and now_ns < down.until_ns:
                self.counters.add(Count.PEER_BACKOFF_FAILED)
                fail(down.err)
                return
            dial = self._dials[agent] = _Dial(addr, now_ns + self._dial_timeout_ns)
            self._t.request_peer(agent, addr.host, addr.port)
        dial.waiting.append((ready, fail))

    def send(
        self,
        addr: PeerAddr,
        frame: bytes | Callable[[], bytes | None],
        now_ns: int,
        fail: OnFail,
        sent: OnReady | None = None,
    ) -> None:
        """Send a notification, dialing first if needed; ``fail`` gets any transport error,
        ``sent`` is called once the transport took it. A callable ``frame`` is built when
        the peer is ready (it may say how much time is left then); None means too late:
        nothing is sent and ``fail`` gets ``NotSent``."""

        def go() -> None:
            data = frame() if callable(frame) else frame
            if data is None:
                fail(NotSent(f"a message to {addr.agent} was due before its peer was ready"))
                return
            try:
                self._t.send_notif(addr.agent, data)
            except TransportError as exc:
                self.lost(addr.agent, exc)
                fail(exc)
                return
            self.ring(addr.agent)
            if sent is not None:
                sent()

        self.when_ready(addr, now_ns, go, fail)

    def lost(self, agent: str, exc: TransportError) -> None:
        """Forget a peer that disconnected, so the next use fetches fresh metadata (it may
        have restarted under the same name); until its backoff has passed, what is sent to
        it fails at once with ``exc``."""
        if isinstance(exc, PeerDisconnected):
            self._addrs.pop(agent, None)
            self._mark_down(agent, exc)
            try:
                self._t.remove_peer(agent)
            except TransportError as err:
                logger.warning("Removing lost peer %s failed: %s", agent, err)

    def poll(self, now_ns: int) -> None:
        self._now_ns = max(self._now_ns, now_ns)
        for agent in list(self._dials):
            dial = self._dials[agent]
            refused = self._t.dial_refused(agent)  # before poll_peer, which may dial again
            if self._t.poll_peer(agent, now_ns / 1e9):
                del self._dials[agent]
                self._down.pop(agent, None)
                for ready, _ in dial.waiting:
                    ready()
                continue
            if refused is None and now_ns < dial.deadline_ns:
                continue
            del self._dials[agent]
            where = f"{agent} at {dial.addr.host}:{dial.addr.port}"
            err: TransportError
            if refused is not None:
                err = PeerGone(f"{where} is gone: {refused}")
                self.counters.add(Count.PEER_GONE)
            else:
                err = PeerUnreachable(f"no metadata from {where}")
                self.counters.add(Count.PEER_UNREACHABLE)
            logger.warning("%s", err)
            self._mark_down(agent, err)
            try:
                self._t.remove_peer(agent)
            except TransportError as exc:
                # Safe: its metadata never loaded, so only dial state may linger, and
                # the next use of this peer dials afresh.
                logger.debug("Forgetting unreachable peer %s failed: %s", agent, exc)
            for _, fail in dial.waiting:
                fail(err)

    def _mark_down(self, agent: str, err: TransportError) -> None:
        lo, hi = self._backoff
        before = self._down.get(agent)
        delay = lo if before is None else min(hi, before.delay_ns * 2)
        if len(self._down) >= _PRUNE_AT:
            self._down = {a: d for a, d in self._down.items() if d.until_ns > self._now_ns}
        self._down[agent] = _Down(err, self._now_ns + delay, delay)

    def backing_off(self, agent: str) -> bool:
        """Whatever is sent to ``agent`` now fails at once (it is gone or unreachable)."""
        down = self._down.get(agent)
        return down is not None and self._now_ns < down.until_ns

    @property
    def dialing(self) -> bool:
        return bool(self._dials)
