"""The staged path's bookkeeping: chunks, the bounded slot pool, and both sides' schedules.

Owns: ``Chunk``/``plan_chunks`` (a request's rows cut into layer chunks that each fit one
staging slot), ``SlotPool`` (a fixed set of slots of one preallocated buffer: never an
allocation per request; ``acquire`` answers None when empty, and the caller waits or
falls back to the direct path), ``StagedSend`` (P: which chunk to gather, which to WRITE
into which of D's slots) and ``StagedRecv`` (D: which chunk to scatter, which slot to hand
back), and the two notifications between them (``ChunkWritten``, ``SlotFreed``).

A chunk moves gather (P's slot) -> WRITE (P's slot into a D slot P holds a credit for)
-> scatter (D's slot) -> D's slot credited back; chunks overlap in these stages.

Pure: no torch, no transport, no clock. ``connector.transfer.gpu.staged`` drives it.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Sequence

import msgspec

from connector.core.errors import LocalProtocolError, RemoteProtocolError


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Rows [block_start, block_end) of regions [region_start, region_end) of a request,
    laid out region-major in a slot: row (r, j) at ((r - region_start) * blocks + j)."""

    index: int
    region_start: int
    region_end: int
    block_start: int
    block_end: int
    row_bytes: int

    @property
    def regions(self) -> tuple[int, int]:
        return self.region_start, self.region_end

    @property
    def blocks(self) -> int:
        return self.block_end - self.block_start

    @property
    def nbytes(self) -> int:
        return (self.region_end - self.region_start) * self.blocks * self.row_bytes


def plan_chunks(
    num_regions: int, num_blocks: int, row_bytes: int, slot_bytes: int, min_chunks: int = 1
) -> list[Chunk]:
    """Cut a request of ``num_blocks`` rows in each of ``num_regions`` regions into chunks of
    whole regions (layers) that fit ``slot_bytes``; at least ``min_chunks`` where there are
    enough regions, so the stages can overlap. A region bigger than a slot is cut by blocks.
    Both sides compute the same plan from the same numbers."""
    if num_regions < 0 or num_blocks < 0 or row_bytes <= 0 or min_chunks < 1:
        raise LocalProtocolError("plan_chunks: bad geometry")
    if row_bytes > slot_bytes:
        raise LocalProtocolError(f"plan_chunks: a row of {row_bytes} B exceeds the slot")
    if num_regions == 0 or num_blocks == 0:
        return []
    per_region = num_blocks * row_bytes
    if per_region <= slot_bytes:
        fit = slot_bytes // per_region
        k = max(-(-num_regions // fit), min(min_chunks, num_regions))
        bounds = [num_regions * i // k for i in range(k + 1)]  # sizes differ by one at most
        return [Chunk(i, bounds[i], bounds[i + 1], 0, num_blocks, row_bytes) for i in range(k)]
    rows = slot_bytes // row_bytes
    out: list[Chunk] = []
    for r in range(num_regions):
        for b in range(0, num_blocks, rows):
            out.append(Chunk(len(out), r, r + 1, b, min(b + rows, num_blocks), row_bytes))
    return out


class SlotPool:
    """``num_slots`` slots of ``slot_bytes`` in one buffer; slot i starts at i * slot_bytes."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        if num_slots <= 0 or slot_bytes <= 0:
            raise LocalProtocolError("SlotPool: num_slots and slot_bytes must be > 0")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._free: deque[int] = deque(range(num_slots))
        self.waits = 0  # acquire calls answered None (back-pressure)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def free_count(self) -> int:
        return len(self._free)

    def offset(self, slot: int) -> int:
        self._check(slot)
        return slot * self.slot_bytes

    def acquire(self) -> int | None:
        if not self._free:
            self.waits += 1
            return None
        return self._free.popleft()

    def acquire_many(self, n: int) -> list[int] | None:
        """All of ``n`` slots or none (D reserving slots for one transfer)."""
        if n > len(self._free):
            self.waits += 1
            return None
        return [self._free.popleft() for _ in range(n)]

    def release(self, slot: int) -> None:
        self._check(slot)
        if slot in self._free:
            raise LocalProtocolError(f"SlotPool: slot {slot} released twice")
        self._free.append(slot)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise LocalProtocolError(f"SlotPool: no slot {slot}")


class StagedSend:
    """P's schedule for one staged transfer. ``remote_slots`` are D's slots reserved for it
    (its credits); each comes back through ``credited`` once D has scattered out of it."""

    def __init__(self, chunks: Sequence[Chunk], pool: SlotPool, remote_slots: Iterable[int]):
        if any(c.nbytes > pool.slot_bytes for c in chunks):
            raise LocalProtocolError("StagedSend: a chunk does not fit a local slot")
        self.chunks = list(chunks)
        self._pool = pool
        self._credits: deque[int] = deque(remote_slots)
        if not self._credits and self.chunks:
            raise LocalProtocolError("StagedSend: no remote slots")
        self._owned = set(self._credits)
        self._next_gather = 0
        self._next_write = 0
        self._local: dict[int, int] = {}  # chunk -> local slot, from gather until written
        self._gathered: set[int] = set()
        self._written: set[int] = set()

    def gathers_to_start(self) -> list[tuple[Chunk, int]]:
        """Next chunks, in order, each with a local slot taken from the pool."""
        out = []
        while self._next_gather < len(self.chunks):
            slot = self._pool.acquire()
            if slot is None:
                break
            chunk = self.chunks[self._next_gather]
            self._local[chunk.index] = slot
            out.append((chunk, slot))
            self._next_gather += 1
        return out

    def gathered(self, index: int) -> None:
        if index not in self._local or index in self._gathered:
            raise LocalProtocolError(f"StagedSend: chunk {index} was not being gathered")
        self._gathered.add(index)

    def writes_to_post(self) -> list[tuple[Chunk, int, int]]:
        """(chunk, local slot, remote slot) for gathered chunks in order, one per credit."""
        out = []
        while (
            self._next_write < len(self.chunks)
            and self._next_write in self._gathered
            and self._credits
        ):
            chunk = self.chunks[self._next_write]
            out.append((chunk, self._local[chunk.index], self._credits.popleft()))
            self._next_write += 1
        return out

    def written(self, index: int) -> None:
        """The WRITE of chunk ``index`` is done: its local slot goes back to the pool."""
        if index >= self._next_write or index in self._written:
            raise LocalProtocolError(f"StagedSend: chunk {index} was not being written")
        self._written.add(index)
        self._pool.release(self._local.pop(index))

    def credited(self, remote_slot: int) -> None:
        if remote_slot not in self._owned or remote_slot in self._credits:
            raise RemoteProtocolError(f"StagedSend: unexpected credit for slot {remote_slot}")
        self._credits.append(remote_slot)

    def abort(self) -> None:
        """Give every local slot back (the transfer failed or was cancelled)."""
        for slot in self._local.values():
            self._pool.release(slot)
        self._local.clear()

    @property
    def done(self) -> bool:
        return len(self._written) == len(self.chunks)


class StagedRecv:
    """D's schedule for one staged transfer: chunks arrive in any order, each is scattered,
    and its slot is credited back to P; the KV is ready when every scatter has finished."""

    def __init__(self, chunks: Sequence[Chunk], slots: Iterable[int]) -> None:
        self.chunks = list(chunks)
        self.slots = tuple(slots)
        self._scattering: dict[int, int] = {}  # chunk -> slot
        self._scattered: set[int] = set()

    def arrived(self, index: int, slot: int) -> Chunk:
        if not 0 <= index < len(self.chunks):
            raise RemoteProtocolError(f"StagedRecv: no chunk {index}")
        if slot not in self.slots or slot in self._scattering.values():
            raise RemoteProtocolError(f"StagedRecv: slot {slot} not free for chunk {index}")
        if index in self._scattering or index in self._scattered:
            raise RemoteProtocolError(f"StagedRecv: chunk {index} arrived twice")
        self._scattering[index] = slot
        return self.chunks[index]

    def scattered(self, index: int) -> int:
        """Chunk ``index`` is in place; returns the slot to credit back to P."""
        if index not in self._scattering:
            raise LocalProtocolError(f"StagedRecv: chunk {index} was not being scattered")
        self._scattered.add(index)
        return self._scattering.pop(index)

    @property
    def ready(self) -> bool:
        return len(self._scattered) == len(self.chunks)


# -- notifications ---------------------------------------------------------------------

_PREFIX = b"pkvst"


class ChunkWritten(msgspec.Struct, frozen=True, tag="chunk"):
    """P -> D, the notification of a chunk's WRITE: chunk ``index`` is in D's ``slot``."""

    transfer_id: str
    index: int
    slot: int
    version: int = 1


class SlotFreed(msgspec.Struct, frozen=True, tag="freed"):
    """D -> P: ``slot`` has been scattered out of; P may WRITE into it again."""

    transfer_id: str
    slot: int
    version: int = 1


StagingNotif = ChunkWritten | SlotFreed
_decoder = msgspec.msgpack.Decoder(StagingNotif)


def encode_notif(msg: StagingNotif) -> bytes:
    return _PREFIX + msgspec.msgpack.encode(msg)


def is_staging_notif(raw: bytes) -> bool:
    return raw.startswith(_PREFIX)


def decode_notif(raw: bytes) -> StagingNotif:
    """RemoteProtocolError for anything malformed or of an unknown version."""
    if not is_staging_notif(raw):
        raise RemoteProtocolError("not a staging notification")
    try:
        msg = _decoder.decode(raw[len(_PREFIX) :])
    except msgspec.DecodeError as exc:
        raise RemoteProtocolError(f"bad staging notification: {exc}") from exc
    if msg.version != 1:
        raise RemoteProtocolError(f"staging notification version {msg.version}")
    return msg
