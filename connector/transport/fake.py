"""An in-process fake of the transport, for unit tests of pure logic.

Over 400 lines, one job: the fake must mirror every Transport behaviour and fault knob in one place.

Owns: ``FakeFabric`` (a registry of fake agents plus fault-injection knobs) and
``FakeTransport`` (the ``Transport`` Protocol; WRITEs copy bytes with ctypes.memmove).
Must not import: nixl, torch, threads. Time comes from the fabric's ``clock``/``sleep``
(only ``connect`` uses them), so tests can inject a fake clock.

Faithful to NIXL where it matters to callers (tests/integration/test_nixl_transport.py
holds the real one to the same): a WRITE's notification reaches the target only after its
bytes are in place; a peer whose metadata we hold but whose process died raises
PeerDisconnected; a peer whose metadata we never loaded raises PeerUnknown; a
receive-only target can get WRITEs and their notifications without the initiator's
metadata, but cannot notify it back. Metadata exchange is immediate here (the real side
channel takes a round trip).
"""

from __future__ import annotations

import ctypes
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from connector.core.errors import (
    LocalProtocolError,
    PeerDisconnected,
    PeerUnknown,
    TransportError,
)
from connector.transport.base import (
    DialBook,
    WriteHandle,
    check_mem_kind,
    extents_to_rows,
    tensor_extents,
    validate_write_descs,
)
from telemetry.counts import Counts


@dataclass
class _Rule:
    """One injected fault: applies to matching events while ``remaining`` (None = always)."""

    remaining: int | None
    src: str | None = None
    dst: str | None = None
    prefix: bytes | None = None
    polls: int = 0
    at: str = "post"
    error: type[TransportError] = TransportError

    def matches(self, src: str, dst: str, msg: bytes = b"") -> bool:
        return (
            (self.remaining is None or self.remaining > 0)
            and (self.src is None or self.src == src)
            and (self.dst is None or self.dst == dst)
            and (self.prefix is None or msg.startswith(self.prefix))
        )

    def consume(self) -> None:
        if self.remaining is not None:
            self.remaining -= 1


def _take(rules: list[_Rule], src: str, dst: str, msg: bytes = b"") -> _Rule | None:
    for rule in rules:
        if rule.matches(src, dst, msg):
            rule.consume()
            return rule
    return None


@dataclass(frozen=True)
class PostedWrite:
    """What the fabric saw posted (for assertions such as "one WRITE per transfer")."""

    src: str
    dst: str
    bytes_total: int
    descs_total: int
    notif: bytes


@dataclass
class _FakeXfer:
    target: FakeTransport
    src: np.ndarray
    dst: np.ndarray
    notif: bytes
    polls_left: int
    fail: type[TransportError] | None  # raise this when the write would complete


class FakeFabric:
    """The shared "network" of fake transports, with knobs to inject faults."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.clock = clock
        self.sleep = sleep
        self._by_addr: dict[tuple[str, int], FakeTransport] = {}
        self._unreachable: set[str] = set()
        self._delay_rules: list[_Rule] = []
        self._fail_rules: list[_Rule] = []
        self._drop_rules: list[_Rule] = []
        self._dup_rules: list[_Rule] = []
        self._reorder: dict[str, random.Random | None] = {}
        self._next_port = 30000
        self.posted: list[PostedWrite] = []
        self.notifs_dropped = 0
        self.notifs_duplicated = 0

    # -- agents ---------------------------------------------------------------------

    def transport(
        self, name: str, *, host: str = "127.0.0.1", port: int | None = None
    ) -> FakeTransport:
        if port is None:
            port = self._next_port
            self._next_port += 1
        if (host, port) in self._by_addr:
            raise TransportError(f"create agent: {host}:{port} already in use")
        t = FakeTransport(self, name, (host, port))
        self._by_addr[(host, port)] = t
        return t

    def _unlisten(self, t: FakeTransport) -> None:
        if self._by_addr.get(t.listen_address) is t:
            del self._by_addr[t.listen_address]

    def _listener(self, host: str, port: int, peer: str) -> FakeTransport | None:
        t = self._by_addr.get((host, port))
        if t is None or t.name != peer or peer in self._unreachable:
            return None
        return t

    # -- fault knobs ----------------------------------------------------------------

    def delay_writes(
        self,
        polls: int,
        *,
        src: str | None = None,
        dst: str | None = None,
        count: int | None = None,
    ) -> None:
        """Matching WRITEs stay in flight for ``polls`` poll_write calls (0 = DONE at post)."""
        self._delay_rules.insert(0, _Rule(count, src, dst, polls=polls))

    def fail_writes(
        self,
        at: Literal["post", "poll"] = "post",
        *,
        src: str | None = None,
        dst: str | None = None,
        count: int | None = 1,
        error: type[TransportError] = TransportError,
    ) -> None:
        """Matching WRITEs raise ``error`` at post, or at the poll where they would
        complete (no bytes land, no notification)."""
        if at not in ("post", "poll"):
            raise LocalProtocolError(f"fail_writes(at={at!r})")
        self._fail_rules.insert(0, _Rule(count, src, dst, at=at, error=error))

    def drop_notifs(
        self,
        count: int | None = 1,
        *,
        src: str | None = None,
        dst: str | None = None,
        prefix: bytes | None = None,
    ) -> None:
        self._drop_rules.insert(0, _Rule(count, src, dst, prefix))

    def duplicate_notifs(
        self,
        count: int | None = 1,
        *,
        src: str | None = None,
        dst: str | None = None,
        prefix: bytes | None = None,
    ) -> None:
        self._dup_rules.insert(0, _Rule(count, src, dst, prefix))

    def reorder_notifs(self, dst: str, *, seed: int | None = None, enabled: bool = True) -> None:
        """Each get_notifs of ``dst`` returns its batch reversed (seed None) or shuffled."""
        if enabled:
            self._reorder[dst] = None if seed is None else random.Random(seed)
        else:
            self._reorder.pop(dst, None)

    def set_unreachable(self, name: str, unreachable: bool = True) -> None:
        """Metadata requests to ``name`` go unanswered (a silent host, a dropped SYN). A
        request to an address where nothing listens (a peer that died or closed) is
        refused instead (``dial_refused``), as a real side channel's connect is."""
        (self._unreachable.add if unreachable else self._unreachable.discard)(name)

    def disconnect(self, name: str) -> None:
        """The process behind ``name`` dies: its listener goes, and every peer holding
        its metadata gets PeerDisconnected from writes, polls and notifications."""
        for t in list(self._by_addr.values()):
            if t.name == name:
                t._die()

    def clear_faults(self) -> None:
        for rules in (self._delay_rules, self._fail_rules, self._drop_rules, self._dup_rules):
            rules.clear()
        self._reorder.clear()
        self._unreachable.clear()

    # -- delivery -------------------------------------------------------------------

    def _deliver(self, src: str, target: FakeTransport, msg: bytes) -> None:
        if _take(self._drop_rules, src, target.name, msg) is not None:
            self.notifs_dropped += 1
            return
        copies = 1
        if _take(self._dup_rules, src, target.name, msg) is not None:
            self.notifs_duplicated += 1
            copies = 2
        if target.alive:
            target._inbox.extend([(src, msg)] * copies)

    def _order(self, dst: str, batch: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        if dst not in self._reorder:
            return batch
        rng = self._reorder[dst]
        if rng is None:
            return batch[::-1]
        rng.shuffle(batch)
        return batch


class FakeTransport:
    """``Transport`` on a ``FakeFabric``. Create with ``fabric.transport(name)``."""

    def __init__(self, fabric: FakeFabric, name: str, listen: tuple[str, int]) -> None:
        self.counters: Counts = Counts()  # none yet: the fake counts nothing of its own
        self._fabric = fabric
        self._name = name
        self._listen = listen
        self.alive = True  # False once closed or disconnected ("the process is gone")
        self._regions: list[tuple[int, int, str]] = []  # (start, end, mem kind)
        self._known: dict[str, FakeTransport] = {}  # peer name -> the agent whose MD we hold
        self._handles: set[WriteHandle] = set()
        self._inbox: list[tuple[str, bytes]] = []
        self._dials = DialBook(self._fire_request, self.peer_ready)
        self._refused: dict[str, str] = {}

    @property
    def name(self) -> str:
        return self._name

    @property
    def listen_address(self) -> tuple[str, int]:
        return self._listen

    def _check_alive(self) -> None:
        if not self.alive:
            raise TransportError(f"transport {self._name!r} is closed")

    def _die(self) -> None:
        self.alive = False
        self._fabric._unlisten(self)
        self._inbox.clear()

    # -- memory ---------------------------------------------------------------------

    def register_memory(
        self, extents: Sequence[tuple[int, int]], mem_type: str = "DRAM", device_id: int = 0
    ) -> None:
        self._check_alive()
        if check_mem_kind(mem_type) != "DRAM":
            raise TransportError(f"register: the fake transport copies DRAM only, not {mem_type}")
        for addr, nbytes, _ in extents_to_rows(extents, device_id).tolist():
            self._regions.append((int(addr), int(addr) + int(nbytes), mem_type))

    def register_tensors(self, tensors: Sequence[Any]) -> None:
        for (mem_type, device_id), extents in tensor_extents(tensors).items():
            self.register_memory(extents, mem_type, device_id)

    def deregister_all(self) -> None:
        self._check_alive()
        self._regions.clear()

    def _covered(self, rows: np.ndarray, mem_type: str) -> bool:
        for addr, nbytes, _ in rows.tolist():
            if not any(
                s <= addr and addr + nbytes <= e and m == mem_type for s, e, m in self._regions
            ):
                return False
        return True

    # -- peers ----------------------------------------------------------------------

    def _fire_request(self, peer: str, host: str, port: int) -> None:
        self._check_alive()
        self._refused.pop(peer, None)
        if (host, port) not in self._fabric._by_addr and peer not in self._fabric._unreachable:
            self._refused[peer] = f"{host}:{port}: connection refused"
        target = self._fabric._listener(host, port, peer)
        if target is not None:  # both directions, like one side-channel exchange
            self._known[peer] = target
            target._known[self._name] = self

    def request_peer(
        self, peer: str, host: str, port: int, *, retry_interval_s: float = 0.05
    ) -> None:
        self._dials.request(peer, host, port, retry_interval_s, self._fabric.clock())

    def peer_ready(self, peer: str) -> bool:
        self._check_alive()
        return peer in self._known

    def poll_peer(self, peer: str, now_s: float) -> bool:
        return self._dials.poll(peer, now_s)

    def dial_refused(self, peer: str) -> str | None:
        return self._refused.get(peer)

    def connect(
        self, peer: str, host: str, port: int, timeout_s: float, retry_interval_s: float = 0.05
    ) -> None:
        self._dials.connect(
            peer,
            host,
            port,
            timeout_s,
            retry_interval_s,
            clock=self._fabric.clock,
            sleep=self._fabric.sleep,
        )

    def _target(self, op: str, peer: str) -> FakeTransport:
        target = self._known.get(peer)
        if target is None:
            raise PeerUnknown(f"{op} (peer {peer!r}): metadata not loaded")
        if not target.alive:
            raise PeerDisconnected(f"{op} (peer {peer!r}): remote agent disconnected")
        return target

    def remove_peer(self, peer: str) -> None:
        self._check_alive()
        for handle in [h for h in self._handles if h.peer == peer]:
            if not handle.done and handle.error is None:  # fails at its next poll, as in NIXL
                handle.error = PeerDisconnected(f"write (peer {peer!r}): peer removed in flight")
            self.release(handle)
        self._known.pop(peer, None)
        self._dials.forget(peer)

    # -- writes ---------------------------------------------------------------------

    def write(
        self,
        peer: str,
        src: np.ndarray,
        dst: np.ndarray,
        notif: bytes,
        *,
        src_mem: str = "DRAM",
        dst_mem: str = "DRAM",
    ) -> WriteHandle:
        self._check_alive()
        src_a, dst_a, nbytes = validate_write_descs(src, dst)
        target = self._target("post write", peer)
        if not self._covered(src_a, check_mem_kind(src_mem)) or not target._covered(
            dst_a, check_mem_kind(dst_mem)
        ):
            raise TransportError(
                f"prepare write (peer {peer!r}): descriptors outside registered memory"
            )
        fab = self._fabric
        fab.posted.append(PostedWrite(self._name, peer, nbytes, int(src_a.shape[0]), notif))
        fail = _take(fab._fail_rules, self._name, peer)
        if fail is not None and fail.at == "post":
            raise fail.error(f"post write (peer {peer!r}): injected failure")
        delay = _take(fab._delay_rules, self._name, peer)
        xfer = _FakeXfer(
            target,
            src_a.copy(),
            dst_a.copy(),
            bytes(notif),
            polls_left=delay.polls if delay else 0,
            fail=fail.error if fail is not None else None,
        )
        handle = WriteHandle(peer, nbytes, int(src_a.shape[0]), time.time_ns(), native=xfer)
        self._handles.add(handle)
        if xfer.polls_left == 0 and xfer.fail is None:
            self._complete(handle)
        return handle

    def _complete(self, handle: WriteHandle) -> None:
        xfer: _FakeXfer = handle.native
        for (s, n, _), (d, _, _) in zip(xfer.src.tolist(), xfer.dst.tolist(), strict=True):
            ctypes.memmove(int(d), int(s), int(n))
        handle.done = True
        self._fabric._deliver(self._name, xfer.target, xfer.notif)

    def poll_write(self, handle: WriteHandle) -> bool:
        if handle.error is not None:
            raise handle.error
        if handle.done:
            return True
        if handle.released:
            raise LocalProtocolError("poll_write on a released, unfinished handle")
        self._check_alive()
        xfer: _FakeXfer = handle.native
        try:
            if not xfer.target.alive:
                raise PeerDisconnected(
                    f"poll write (peer {handle.peer!r}): remote agent disconnected"
                )
            if xfer.polls_left > 0:
                xfer.polls_left -= 1
                return False
            if xfer.fail is not None:
                raise xfer.fail(f"poll write (peer {handle.peer!r}): injected failure")
        except TransportError as exc:
            handle.error = exc
            raise
        self._complete(handle)
        return True

    def release(self, handle: WriteHandle) -> None:
        if handle.released:
            return
        handle.released = True  # an unfinished fake WRITE is cancelled: no bytes land
        handle.native = None
        self._handles.discard(handle)

    # -- notifications --------------------------------------------------------------

    def send_notif(self, peer: str, msg: bytes) -> None:
        self._check_alive()
        self._fabric._deliver(self._name, self._target("send notif", peer), bytes(msg))

    def get_notifs(self) -> list[tuple[str, bytes]]:
        self._check_alive()
        batch, self._inbox = self._inbox, []
        return self._fabric._order(self._name, batch)

    def progress(self) -> None:
        self._check_alive()  # delivery is immediate here: nothing to drive

    # -- teardown -------------------------------------------------------------------

    def close(self) -> None:
        if not self.alive:
            return
        for handle in list(self._handles):
            self.release(handle)
        self.deregister_all()
        for peer in list(self._known):
            self.remove_peer(peer)
        self._die()

    def __enter__(self) -> FakeTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
