"""Events that enter the protocol core and actions that leave it.

Owns: the vocabulary of the sans-IO core. Events are past-tense nouns, actions imperative
verbs (style.md). Frozen dataclasses: cheap, hashable, printable in hypothesis' notes.
Imports only the message structs; nothing of vLLM, NIXL or threads.
"""

from __future__ import annotations

from dataclasses import dataclass

from connector.core.messages import FailReason, PeerAddr, Register, TraceContext

BlockTable = tuple[tuple[int, ...], ...]
"""Block ids per KV group."""


# ---------------------------------------------------------------- P side (sender) events
@dataclass(frozen=True)
class Registered:
    """A D rank's registration arrived. ``since_ns``: the earliest it can have arrived (the
    transport's previous read; a P that was stopped reads it late), None: when handled."""

    reg: Register
    since_ns: int | None = None


@dataclass(frozen=True)
class PrefillDone:
    """P's scheduler finished the prompt and handed its blocks over (delay_free=True)."""

    transfer_id: str
    request_id: str
    block_ids: BlockTable
    num_tokens: int


@dataclass(frozen=True)
class PrefillAborted:
    """P's request ended without usable KV (abort, error); vLLM freed its blocks itself."""

    transfer_id: str
    request_id: str


@dataclass(frozen=True)
class SourceReclaimed:
    """vLLM took P's source blocks back (the request was preempted after its push began,
    or it stopped with no D to follow). Nothing may be written from them any more; D must
    not use what it gets. ``reason``: how a transfer still waiting for D ends."""

    transfer_id: str
    reason: FailReason = FailReason.PREFILL_ABORTED


@dataclass(frozen=True)
class WriteDone:
    """Every WRITE of the transfer reached DONE."""

    transfer_id: str


@dataclass(frozen=True)
class WriteFailed:
    """A WRITE of the transfer could not be posted or ended in error; none is in flight now."""

    transfer_id: str
    reason: FailReason
    detail: str = ""


@dataclass(frozen=True)
class Cancelled:
    """A D rank no longer wants the KV."""

    transfer_id: str
    d_rank: int
    d_addr: PeerAddr
    reason: FailReason


@dataclass(frozen=True)
class HeartbeatSeen:
    """D renewed its interest in the transfer (and says where it waits: a transfer we
    already ended is answered again there)."""

    transfer_id: str
    d_addr: PeerAddr


# ---------------------------------------------------------------- D side (receiver) events
@dataclass(frozen=True)
class Source:
    """One P rank that writes into this D rank, and where to reach it. ``p_rank`` is its
    source rank (``connector.core.stages.source_rank``): the TP rank at PP 1."""

    p_rank: int
    addr: PeerAddr


@dataclass(frozen=True)
class Expected:
    """D allocated blocks for a transfer and wants them filled by ``sources``: one per
    writing P TP rank per P pipeline stage (``p_pp_size``, which each registration names)."""

    transfer_id: str
    request_id: str
    sources: tuple[Source, ...]
    block_ids: BlockTable
    first_token: int
    num_tokens: int
    trace: TraceContext | None = None
    p_pp_size: int = 1


@dataclass(frozen=True)
class CompletionSeen:
    """A P rank's completion notification arrived."""

    transfer_id: str
    p_rank: int


@dataclass(frozen=True)
class FailSeen:
    """A P rank said it will not write (or its WRITE failed)."""

    transfer_id: str
    p_rank: int
    reason: FailReason


@dataclass(frozen=True)
class SendFailed:
    """A message of this transfer to a P rank could not be delivered: that rank never saw
    our registration, or is gone; either way it will not write."""

    transfer_id: str
    p_rank: int
    reason: FailReason


@dataclass(frozen=True)
class PeerLost:
    """The transport says the agent is gone: nothing it might have posted can still land."""

    agent: str


@dataclass(frozen=True)
class NotNeeded:
    """D's prefix cache already holds the prompt: tell the sources to free their blocks.
    No record is kept and nothing is awaited."""

    transfer_id: str
    sources: tuple[Source, ...]


@dataclass(frozen=True)
class AbortRequested:
    """D's request finished (abort, error) while waiting for its KV."""

    transfer_id: str


# ---------------------------------------------------------------- either side
@dataclass(frozen=True)
class ShutdownDue:
    """This engine is shutting down and waits no longer for this transfer. P: one that is
    not writing yet ends now (its blocks back, D told ``shutdown``), a WRITE in flight runs
    to its end. D: one still awaited is cancelled (P answers, then D reports it failed)."""

    transfer_id: str


# ---------------------------------------------------------------- actions (P side)
@dataclass(frozen=True)
class IssueWrite:
    """Build descriptors and post the WRITE(s) into every registered D rank."""

    transfer_id: str
    request_id: str
    block_ids: BlockTable
    num_tokens: int
    registrations: tuple[Register, ...]


@dataclass(frozen=True)
class AbortWrite:
    """The WRITE ran past its deadline: release it; report WriteFailed once none is in flight."""

    transfer_id: str


@dataclass(frozen=True)
class FreeBlocks:
    """Give P's source blocks back to the scheduler (finished_sending)."""

    transfer_id: str
    request_id: str


@dataclass(frozen=True)
class SendFail:
    """Tell these D ranks that this P rank will not write."""

    transfer_id: str
    to: tuple[PeerAddr, ...]
    reason: FailReason


@dataclass(frozen=True)
class ResendCompletion:
    """D asks about a transfer whose WRITE already landed: tell it again, with a plain
    notification (the WRITE's own one was lost or crossed D's cancel)."""

    transfer_id: str
    to: tuple[PeerAddr, ...]


# ---------------------------------------------------------------- actions (D side)
@dataclass(frozen=True)
class SendRegister:
    """Send our registration to one P rank."""

    transfer_id: str
    source: Source


@dataclass(frozen=True)
class SendCancel:
    """Ask these P ranks to stand down; each answers with Fail or its completion."""

    transfer_id: str
    to: tuple[Source, ...]
    reason: FailReason


@dataclass(frozen=True)
class SendHeartbeat:
    """Renew P's leases for these transfers (batched per P agent)."""

    to: PeerAddr
    transfer_ids: tuple[str, ...]


@dataclass(frozen=True)
class ReportReceived:
    """Report the request in finished_recving (and in failed_recving unless ``ok``)."""

    transfer_id: str
    request_id: str
    ok: bool
    reason: FailReason | None = None


SendEvent = (
    Registered
    | PrefillDone
    | PrefillAborted
    | SourceReclaimed
    | WriteDone
    | WriteFailed
    | Cancelled
    | HeartbeatSeen
    | ShutdownDue
)
"""What enters P's table (SenderTable.handle); its own deadlines come as state.DeadlinePassed."""
RecvEvent = Expected | CompletionSeen | FailSeen | SendFailed | AbortRequested | ShutdownDue
"""What D's transitions take; ReceiverTable.handle also takes PeerLost, which it fans out."""
SendAction = IssueWrite | AbortWrite | FreeBlocks | SendFail | ResendCompletion
RecvAction = SendRegister | SendCancel | SendHeartbeat | ReportReceived
