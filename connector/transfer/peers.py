"""Reaching peers: dial on first use, queue work until the peer's metadata is loaded.

Owns: per-peer dial deadlines, the callbacks waiting on each peer, each peer's address
and ringing its doorbell (``connector.transfer.doorbell``) after we sent it something. Used only
from the transfer thread. Knows the Transport protocol, not NIXL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from connector.core.errors import PeerDisconnected, PeerUnreachable, TransportError
from connector.core.messages import PeerAddr
from connector.transfer.doorbell import MESSAGE, Doorbell
from connector.transport.base import Transport

logger = logging.getLogger(__name__)

OnReady = Callable[[], None]
OnFail = Callable[[TransportError], None]


class NotSent(TransportError):
    """A message that was no longer worth sending when its peer became reachable."""


@dataclass
class _Dial:
    addr: PeerAddr
    deadline_ns: int
    waiting: list[tuple[OnReady, OnFail]] = field(default_factory=list)


class Peers:
    """Run callbacks once a peer is reachable, or fail them when its dial times out."""

    def __init__(
        self,
        transport: Transport,
        dial_timeout_ns: int = 5_000_000_000,
        bell: Doorbell | None = None,
    ) -> None:
        self._t = transport
        self._dial_timeout_ns = dial_timeout_ns
        self._dials: dict[str, _Dial] = {}
        self._addrs: dict[str, PeerAddr] = {}  # every peer we dealt with: where to ring
        self._bell = bell

    def ring(self, agent: str, what: bytes = MESSAGE) -> None:
        """Wake ``agent``'s transfer thread: we just sent it something, or posted a WRITE."""
        addr = self._addrs.get(agent)
        if self._bell is not None and addr is not None:
            self._bell.ring(addr.host, addr.port, what)

    def when_ready(self, addr: PeerAddr, now_ns: int, ready: OnReady, fail: OnFail) -> None:
        """Call ``ready`` now if the peer is loaded, else once it is; ``fail`` on timeout."""
        self._addrs[addr.agent] = addr
        dial = self._dials.get(addr.agent)
        if dial is None and self._t.peer_ready(addr.agent):
            ready()
            return
        if dial is None:
            dial = self._dials[addr.agent] = _Dial(addr, now_ns + self._dial_timeout_ns)
            self._t.request_peer(addr.agent, addr.host, addr.port)
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
        have restarted under the same name)."""
        if isinstance(exc, PeerDisconnected):
            self._addrs.pop(agent, None)
            try:
                self._t.remove_peer(agent)
            except TransportError as err:
                logger.warning("Removing lost peer %s failed: %s", agent, err)

    def poll(self, now_ns: int) -> None:
        for agent in list(self._dials):
            dial = self._dials[agent]
            if self._t.poll_peer(agent, now_ns / 1e9):
                del self._dials[agent]
                for ready, _ in dial.waiting:
                    ready()
            elif now_ns >= dial.deadline_ns:
                del self._dials[agent]
                err = PeerUnreachable(
                    f"no metadata from {agent} at {dial.addr.host}:{dial.addr.port}"
                )
                logger.warning("%s", err)
                try:
                    self._t.remove_peer(agent)
                except TransportError as exc:
                    # Safe: its metadata never loaded, so only dial state may linger, and
                    # the next use of this peer dials afresh.
                    logger.debug("Forgetting unreachable peer %s failed: %s", agent, exc)
                for _, fail in dial.waiting:
                    fail(err)

    @property
    def dialing(self) -> bool:
        return bool(self._dials)
