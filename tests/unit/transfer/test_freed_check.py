"""The freed-block check and the held WRITE (test-only ``_faults``; docs/protocol.md, "No late
WRITE").

P's and D's real endpoints over the fake fabric (whose WRITEs copy bytes): P holds the
WRITE of a 16-token prompt until D's cancel has arrived, then posts it, so every byte
lands after the cancel; D fills the blocks it frees after aborting with a pattern and
checks it until no WRITE may land. With the protocol's rule (D frees only once P has
answered) the pattern stays intact; with the rule broken on purpose (D frees when it
cancels), the check catches the late WRITE: the negative control that shows the e2e test
(tests/e2e/test_faults_e2e.py) can fail.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from connector.config import Faults
from connector.core import events as ev
from connector.core import messages as m
from connector.core import recv_state as state
from connector.core.errors import ConfigError
from connector.core.recv_state import ReceiverPolicy, RecvRecord, RecvState, SourceState
from connector.transfer.metrics import Tee
from pushkv_testing.faults import FaultyTransport
from pushkv_testing.freed_check import PATTERN, FreedCheck
from telemetry.schema import Attr, Count, Outcome, Span
from tests.unit.telemetry.memory import Recorder
from tests.unit.test_endpoints import MS, Pair

POLICY = ReceiverPolicy(
    timeout_ns=100 * MS, write_timeout_ns=50 * MS, grace_ns=20 * MS, heartbeat_interval_ns=MS
)
DUE_MS = 170  # registration + receive timeout + write timeout + grace
BLOCK = 4


class Rig:
    """A Pair whose P holds 16-token WRITEs and whose D checks what it frees."""

    def __init__(self, hold_s: float = 60.0, check_tokens: int = 16) -> None:
        self.pair = pair = Pair(recv_policy=POLICY)
        self.clock_s = 0.0
        faults = Faults(hold_write_tokens=16, hold_write_s=hold_s)
        self.p = FaultyTransport(pair.tp, faults, clock=lambda: self.clock_s)
        pair.sender._t = pair.sender.peers._t = pair.tp = self.p
        self.spans = Recorder()
        self.freed = FreedCheck(
            check_tokens,
            pair.receiver.layout,
            POLICY,
            tracer=self.spans.tracer,
            engine_id="decode",
            clock=lambda: pair.now,
        )
        self.d = FaultyTransport(pair.td, Faults(), self.freed)
        pair.receiver.peers._t = pair.td = self.d
        pair.receiver.spans = Tee(self.freed)

    def start(self) -> None:
        self.pair.expect("t", 16, (BLOCK,))
        self.pair.sender.on_event(ev.PrefillDone("t", "preq", ((1,),), 16), self.pair.now)
        self.pair.pump(rounds=5)
        assert self.pair.receiver.finished == [], "the WRITE is held: D still waits"
        assert self.pair.sender.writes_in_flight() == 1
        assert not np.any(self.pair.d_buf[:, BLOCK]), "no byte landed yet"

    def abort(self) -> None:
        self.pair.receiver.on_event(ev.AbortRequested("t"), self.pair.now)

    def block(self) -> np.ndarray:
        return np.asarray(self.pair.d_buf[:, BLOCK])


def test_d_frees_after_the_held_write_lands_and_the_pattern_stays() -> None:
    rig = Rig()
    rig.start()
    rig.abort()
    rig.pair.pump(rounds=5)  # P sees the cancel, posts, the WRITE lands, its done answers D
    (got,) = rig.pair.receiver.finished
    assert got.ok  # every byte is in: D's blocks are whole, the request is gone anyway
    assert rig.p.counters[f"{Count.INJECTED.value}hold_write"] == 1
    assert np.all(rig.block() == PATTERN), "filled when D freed the blocks"
    rig.pair.pump(rounds=DUE_MS)
    assert rig.freed.counters == {"freed_filled": 1, "freed_intact": 1}
    span = rig.spans.one(Span.FREED_CHECK)
    assert span.status.is_ok and span.attributes[Attr.TRANSFER_ID.value] == "t"


def _free_at_once(rec: RecvRecord, e: ev.AbortRequested, ctx: state.RecvCtx) -> list:
    """The rule broken on purpose: D frees its blocks when it cancels, not once P answered."""
    cancel = ev.SendCancel(rec.transfer_id, rec.pending(), m.FailReason.ABORTED)
    rec.status = dict.fromkeys(rec.status, SourceState.FAILED)
    rec.reason = m.FailReason.ABORTED
    return [cancel, *state._settle(rec, ctx)]


def test_negative_control_the_check_catches_a_write_into_freed_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(state.RECV_TABLE, (RecvState.AWAITING, ev.AbortRequested), _free_at_once)
    rig = Rig()
    rig.start()
    rig.abort()
    (got,) = rig.pair.receiver.finished  # freed at once, the WRITE still held at P
    assert not got.ok
    assert np.all(rig.block() == PATTERN)
    rig.pair.pump(rounds=5)  # P sees the cancel and posts: the bytes land in freed blocks
    assert not np.all(rig.block() == PATTERN)
    assert rig.freed.counters["late_writes"] == 1
    span = rig.spans.one(Span.FREED_CHECK)
    assert not span.status.is_ok
    assert span.attributes[Attr.REASON.value] == Outcome.LATE_WRITE.value


def test_a_held_write_with_no_cancel_is_posted_after_the_hold() -> None:
    rig = Rig(hold_s=0.5)
    rig.start()
    rig.clock_s = 0.5
    rig.pair.pump(rounds=3)
    (got,) = rig.pair.receiver.finished
    assert got.ok and np.any(rig.block())  # the KV, not a pattern: nothing was aborted
    assert rig.freed.counters == {}


def test_a_held_write_aborted_at_its_deadline_is_never_posted() -> None:
    rig = Rig()
    rig.start()
    rig.pair.pump(rounds=60)  # past D's write bound (50 ms): P aborts the unposted WRITE
    (got,) = rig.pair.receiver.finished
    assert not got.ok and got.reason is m.FailReason.WRITE_TIMEOUT
    assert not np.any(rig.block())
    assert rig.pair.sender.finished == ["preq"]


def test_a_new_registration_of_a_checked_block_ends_the_check() -> None:
    rig = Rig()
    rig.start()
    rig.abort()
    rig.pair.pump(rounds=5)
    assert rig.freed.counters["freed_filled"] == 1
    rig.pair.expect("t2", 32, (BLOCK, BLOCK + 1))  # the block is handed out again
    assert rig.freed.counters["freed_intact"] == 1
    rig.spans.one(Span.FREED_CHECK)


def test_the_check_needs_host_memory() -> None:
    gpu = msgspec.structs.replace(Pair().receiver.layout, mem_type="VRAM")
    with pytest.raises(ConfigError):
        FreedCheck(16, gpu, POLICY)
