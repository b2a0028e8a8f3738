"""The transport contract: what the transfer thread may ask of a transport.

Owns: the ``Transport`` Protocol, ``WriteHandle``, the memory-kind names, descriptor
validation and the per-peer dial (retry) bookkeeping shared by every implementation.
Must not import: nixl, torch, vLLM, threads. numpy only (descriptors are Nx3 uint64).

The Protocol holds only what the product calls (the transfer thread, the worker side);
the concrete classes add ``name``, ``connect``, ``progress`` and ``register_tensors`` for
tests, tools and benches.

Contract (every implementation keeps it):
- Nothing on the Protocol blocks. Progress (UCX) happens only inside transport calls,
  so the transfer thread must keep calling ``poll_write``/``get_notifs``:
  a notification sent before the endpoint is wired up, or a WRITE into a target over
  tcp (RMA emulated by active messages), moves only while both sides drive progress.
  A WRITE's notification leaves the initiator when *it* sees the WRITE complete (in
  ``write`` itself, or in a ``poll_write``): an unpolled WRITE never notifies its target.
- A receive-only target needs no metadata of the initiator to get WRITEs and their
  notifications, but it needs it to ``send_notif`` back (``request_peer`` sends ours).
- Every failure surfaces as a ``TransportError`` (``PeerUnreachable``, ``PeerUnknown``,
  ``PeerDisconnected``); a backend exception never escapes. A misuse by the caller
  (bad descriptor shapes, a released handle) raises ``LocalProtocolError``.
- Memory must be registered before the peer fetches our metadata: a region registered
  later is unknown to a peer until ``request_peer`` is called again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from connector.core.errors import LocalProtocolError, PeerUnreachable, TransportError

MemKind = Literal["DRAM", "VRAM"]
MEM_KINDS: tuple[str, ...] = ("DRAM", "VRAM")


@dataclass(eq=False)
class WriteHandle:
    """One posted WRITE. Opaque to callers except for the read-only facts below
    (for spans: peer, bytes_total, descs_total, posted_ns)."""

    peer: str
    bytes_total: int
    descs_total: int
    posted_ns: int
    # Transport-private state; callers must not touch these.
    native: Any = field(default=None, repr=False)
    done: bool = False
    released: bool = False
    error: TransportError | None = field(default=None, repr=False)


@runtime_checkable
class Transport(Protocol):
    """A one-sided WRITE + notification fabric, driven from one thread."""

    @property
    def listen_address(self) -> tuple[str, int]:
        """Where peers fetch our metadata (host, port)."""
        ...

    @property
    def counters(self) -> Mapping[str, int]:
        """The transport's own counters (``telemetry.schema.Count`` names); the transfer
        thread merges them into its own when it stops."""
        ...

    def register_memory(
        self, extents: Sequence[tuple[int, int]], mem_type: str = "DRAM", device_id: int = 0
    ) -> None:
        """Register (addr, nbytes) spans as WRITE sources/targets."""
        ...

    def request_peer(
        self, peer: str, host: str, port: int, *, retry_interval_s: float = 0.05
    ) -> None:
        """Send our metadata to the peer's listener and ask for its metadata (async)."""
        ...

    def peer_ready(self, peer: str) -> bool:
        """True once the peer's metadata is loaded (we can write/notify to it)."""
        ...

    def poll_peer(self, peer: str, now_s: float) -> bool:
        """peer_ready, re-requesting every retry interval (the fetch never retries itself)."""
        ...

    def dial_refused(self, peer: str) -> str | None:
        """Why the latest metadata request to ``peer`` was refused (nothing listens at its
        address any more: its process is gone), or None (no answer yet, answered, or failed
        another way). A definite answer, unlike a timeout; ``request_peer`` clears it."""
        ...

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
        """Post a WRITE of src rows onto dst rows (Nx3 uint64: addr, len, devid). The
        peer gets ``notif`` after the data is in place."""
        ...

    def poll_write(self, handle: WriteHandle) -> bool:
        """True when DONE, False while in flight; raises TransportError on failure."""
        ...

    def release(self, handle: WriteHandle) -> None:
        """Free the handle (cancels it if still in flight). Idempotent."""
        ...

    def send_notif(self, peer: str, msg: bytes) -> None: ...

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """New notifications as (sender, message), oldest first per sender. Drives
        progress."""
        ...

    def remove_peer(self, peer: str) -> None:
        """Forget the peer's metadata and dial state; an unfinished WRITE to it raises
        PeerDisconnected at its next poll. Idempotent."""
        ...

    def close(self) -> None:
        """Release handles, deregister memory, remove peers. Idempotent."""
        ...


def validate_write_descs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Check a WRITE's descriptor pair; return C-contiguous uint64 copies-or-views and the
    byte total. Mismatches are our bug (the descriptor builder's), not the peer's."""
    src_a = np.ascontiguousarray(src, dtype=np.uint64)
    dst_a = np.ascontiguousarray(dst, dtype=np.uint64)
    for label, arr in (("src", src_a), ("dst", dst_a)):
        if arr.ndim != 2 or arr.shape[1] != 3:
            raise LocalProtocolError(
                f"{label} must be an Nx3 (addr, len, devid) array, got shape {arr.shape}"
            )
    if src_a.shape[0] != dst_a.shape[0]:
        raise LocalProtocolError(f"src has {src_a.shape[0]} rows, dst {dst_a.shape[0]}")
    if src_a.shape[0] == 0:
        raise LocalProtocolError("a WRITE needs at least one descriptor")
    if not np.array_equal(src_a[:, 1], dst_a[:, 1]):
        bad = int(np.flatnonzero(src_a[:, 1] != dst_a[:, 1])[0])
        raise LocalProtocolError(
            f"row {bad}: src len {int(src_a[bad, 1])} != dst len {int(dst_a[bad, 1])}"
        )
    if np.any(src_a[:, 1] == 0):
        raise LocalProtocolError("zero-length descriptor")
    return src_a, dst_a, int(src_a[:, 1].sum())


def check_mem_kind(mem_type: str) -> str:
    if mem_type not in MEM_KINDS:
        raise LocalProtocolError(f"unknown memory kind {mem_type!r}; expected one of {MEM_KINDS}")
    return mem_type


def extents_to_rows(extents: Sequence[tuple[int, int]], device_id: int) -> np.ndarray:
    """(addr, nbytes) spans -> Nx3 uint64 rows (addr, len, devid)."""
    rows = np.zeros((len(extents), 3), dtype=np.uint64)
    for i, (addr, nbytes) in enumerate(extents):
        if addr <= 0 or nbytes <= 0:
            raise LocalProtocolError(f"bad extent ({addr:#x}, {nbytes})")
        rows[i] = (addr, nbytes, device_id)
    return rows


def tensor_extents(tensors: Sequence[Any]) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """Group torch tensors by (mem kind, device index) without importing torch: a value
    can only be a tensor if the caller already imported torch."""
    groups: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for t in tensors:
        if not t.is_contiguous():
            raise LocalProtocolError("register_tensors needs contiguous tensors")
        dev = t.device
        if dev.type == "cpu":
            key = ("DRAM", 0)
        elif dev.type == "cuda":
            key = ("VRAM", int(dev.index or 0))
        else:
            raise LocalProtocolError(f"unsupported tensor device {dev}")
        groups.setdefault(key, []).append((int(t.data_ptr()), int(t.numel() * t.element_size())))
    return groups


@dataclass
class PeerDial:
    """Where a peer listens and when we last asked it for metadata."""

    host: str
    port: int
    retry_interval_s: float
    last_request_s: float
    attempts: int = 1


class DialBook:
    """Per-peer retry bookkeeping, so a poll loop (or ``connect``) can re-request a
    peer's metadata every retry interval until it is loaded."""

    def __init__(self, fire: Callable[[str, str, int], None], ready: Callable[[str], bool]):
        self._fire = fire  # sends our MD and asks for the peer's: both fire-and-forget
        self._ready = ready
        self._dials: dict[str, PeerDial] = {}

    def request(
        self, peer: str, host: str, port: int, retry_interval_s: float, now_s: float
    ) -> None:
        self._dials[peer] = PeerDial(host, port, retry_interval_s, now_s)
        self._fire(peer, host, port)

    def poll(self, peer: str, now_s: float) -> bool:
        if self._ready(peer):
            return True
        dial = self._dials.get(peer)
        if dial is None:
            raise LocalProtocolError(f"poll_peer({peer!r}) before request_peer")
        if now_s - dial.last_request_s >= dial.retry_interval_s:
            dial.last_request_s = now_s
            dial.attempts += 1
            self._fire(peer, dial.host, dial.port)
        return False

    def get(self, peer: str) -> PeerDial | None:
        return self._dials.get(peer)

    def forget(self, peer: str) -> None:
        self._dials.pop(peer, None)

    def peers(self) -> list[str]:
        return list(self._dials)

    def connect(
        self,
        peer: str,
        host: str,
        port: int,
        timeout_s: float,
        retry_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        poll: Callable[[str, float], bool] | None = None,
    ) -> None:
        """Blocking dial with bounded retries; PeerUnreachable after timeout_s. ``poll``
        (default: this book's) lets a transport drive its progress while it waits."""
        poll = poll or self.poll
        start = clock()
        deadline = start + timeout_s
        self.request(peer, host, port, retry_interval_s, start)
        while True:
            now = clock()
            if poll(peer, now):
                return
            if now >= deadline:
                dial = self._dials.get(peer)
                attempts = dial.attempts if dial else 0
                raise PeerUnreachable(
                    f"connect {peer!r} at {host}:{port}: no metadata after "
                    f"{timeout_s:.3g}s ({attempts} requests)"
                )
            # Short naps, so an answer is taken in soon after it comes.
            sleep(min(0.005, max(0.0, deadline - now)))
