"""P's record of each transfer whose WRITE this rank runs, and what its WRITEs did.

Owns: ``Phase`` (where a transfer's WRITE stands), ``Transfer`` (one record), ``Transfers``
(this rank's records, and how many have a WRITE our polling must move on), ``Write`` (a
WRITE's transport work in progress) and ``WriteReport`` (what it did, for spans and stats).
The rendezvous table decides when a WRITE starts and ends; a record holds how far its
transport work has got. Only ``connector.transfer.sender``, on the transfer thread, uses it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from connector.core import events as ev
from connector.core import messages as m
from connector.core.xfer_path import XferPath
from connector.transfer.paths import PathWrite
from connector.transport.base import WriteHandle

ReadyCheck = Callable[[], bool]


@dataclass
class WriteReport:
    """What one transfer's WRITEs did; handed to ``on_write_finished`` (spans, stats)."""

    transfer_id: str
    request_id: str
    ok: bool
    reason: m.FailReason | None
    issued_ns: int  # wall clock: rendezvous complete, descriptor prep starts
    prepared_ns: int = 0  # descriptors built
    posted_ns: int = 0  # first WRITE posted
    done_ns: int = 0  # last WRITE observed DONE (or failed)
    bytes_total: int = 0
    descriptors: int = 0
    blocks: int = 0
    regions: int = 0  # KV regions (layer x part) of the layout the transfer spans
    targets: tuple[str, ...] = ()
    path: str = XferPath.DIRECT.value  # connector.core.xfer_path, per target joined by ","
    path_reason: str = ""
    stage_ms: dict[str, float] = field(default_factory=dict)  # device time per stage


@dataclass
class Write:
    report: WriteReport
    unposted: int  # targets still waiting for their peer's metadata
    handles: list[WriteHandle] = field(default_factory=list)
    others: list[PathWrite] = field(default_factory=list)  # targets on a non-direct path
    failure: m.FailReason | None = None
    detail: str = ""
    aborting: bool = False


class Phase(enum.Enum):
    """Where one transfer's WRITE stands on this rank."""

    COMPUTING = "computing"  # GPU: its prefill was submitted with a ready check; no WRITE yet
    DEFERRED = "deferred"  # the table issued the WRITE before the KV was computed
    WRITING = "writing"  # posted (or waiting for a peer's metadata) and not ended
    ENDED = "ended"  # the WRITE ended or never will; kept only for its ready check


ACTIVE = frozenset({Phase.DEFERRED, Phase.WRITING})  # a WRITE our polling must move on


@dataclass
class Transfer:
    """One transfer on this rank, from its prefill's ready check (GPU) or its WRITE's issue
    until the table frees its blocks (or, without a ready check, its WRITE ends)."""

    phase: Phase
    ready: ReadyCheck | None = None  # GPU: "is the KV computed?"
    ready_noted: bool = False  # it said yes, and the prefill span was told
    issue: ev.IssueWrite | None = None  # DEFERRED: the WRITE to post once the KV is computed
    write: Write | None = None  # WRITING


class Transfers:
    """This rank's records by transfer id; a record changes phase only through ``move``."""

    def __init__(self) -> None:
        self._by_id: dict[str, Transfer] = {}
        self.active = 0  # records in an ACTIVE phase

    def get(self, tid: str) -> Transfer | None:
        return self._by_id.get(tid)

    def newly_ready(self) -> Iterator[str]:
        """Transfers whose ready check says yes for the first time (now noted), each as
        its check fires. The caller must not add or drop records while iterating."""
        for tid, rec in self._by_id.items():
            if rec.ready is not None and not rec.ready_noted and rec.ready():
                rec.ready_noted = True
                yield tid

    def due(self) -> list[Transfer]:
        """DEFERRED records whose KV is now computed: their WRITE may be posted."""
        return [
            rec
            for rec in self._by_id.values()
            if rec.phase is Phase.DEFERRED and rec.ready is not None and rec.ready()
        ]

    def in_phase(self, phase: Phase) -> list[str]:
        return [tid for tid, rec in self._by_id.items() if rec.phase is phase]

    def record(self, tid: str) -> Transfer:
        """The transfer's record, a new one (COMPUTING) if it has none."""
        rec = self._by_id.get(tid)
        if rec is None:
            rec = self._by_id[tid] = Transfer(Phase.COMPUTING)
        return rec

    def move(self, tid: str, rec: Transfer, phase: Phase) -> None:
        """The one place a record changes phase (and the count of active WRITEs with it)."""
        self.active += (phase in ACTIVE) - (rec.phase in ACTIVE)
        rec.phase = phase
        if phase is Phase.ENDED and rec.ready is None:
            self._by_id.pop(tid, None)  # nothing left to watch

    def end(self, tid: str, rec: Transfer) -> None:
        rec.issue, rec.write = None, None
        self.move(tid, rec, Phase.ENDED)

    def release(self, tid: str) -> None:
        """The blocks go back: no ready check to watch, no WRITE left to post. A WRITE in
        flight (never, by the table's rules) would still be polled to its end."""
        rec = self._by_id.get(tid)
        if rec is None:
            return
        rec.ready, rec.ready_noted = None, False
        if rec.phase is not Phase.WRITING:
            self.end(tid, rec)

    def quiescent(self, transfer_ids: list[str]) -> bool:
        """No WRITE of these transfers is posted, waiting to be posted, or in flight."""
        return not any(
            (rec := self._by_id.get(t)) is not None and rec.phase in ACTIVE for t in transfer_ids
        )
