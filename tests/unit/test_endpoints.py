"""P's Sender and D's Receiver over the in-process fake transport (pure logic, no threads).

The real-NIXL versions of these paths are in tests/integration; here the fake makes the
failure paths deterministic: post errors, unreachable peers, layout mismatches, a GPU
step that has not finished, spoofed senders, malformed frames.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from connector.core import events as ev
from connector.core import messages as m
from connector.core.state import ReceiverPolicy
from connector.tools.loopback import RankSpec, expected_event
from connector.transfer.guard import Guard
from connector.transfer.peers import NotSent, Peers
from connector.transfer.receiver import Receiver
from connector.transfer.send_records import Phase
from connector.transfer.sender import Sender
from connector.transfer.thread import TransferThread
from connector.transfer.topology import RankInfo, Topology
from connector.transport.fake import FakeFabric

MS = 1_000_000


class Pair:
    """One P rank and one D rank on a fake fabric, pumped by hand."""

    def __init__(
        self,
        d_num_tokens_delta: int = 0,
        dial_timeout_ns: int = 50 * MS,
        guards: tuple[Guard, Guard] | None = None,
        recv_policy: ReceiverPolicy = ReceiverPolicy(),
    ) -> None:
        """``guards``: P's and D's codecs (with a secret: sealed notifications)."""
        self.fabric = FakeFabric()
        self.p_guard, self.d_guard = guards or (Guard(), Guard())
        self.now = 0
        self.p_spec = RankSpec("P", "prefill", 0, 1, 16000)
        self.d_spec = RankSpec("D", "decode", 0, 1, 17000)
        self.p_buf, self.d_buf = self.p_spec.allocate(), self.d_spec.allocate()
        self.tp = self.fabric.transport(self.p_spec.agent, port=self.p_spec.port)
        self.td = self.fabric.transport(self.d_spec.agent, port=self.d_spec.port)
        p_layout, d_layout = self.p_spec.layout(self.p_buf), self.d_spec.layout(self.d_buf)
        self.tp.register_memory(p_layout.memory_extents())
        self.td.register_memory(d_layout.memory_extents())
        self.reports: list = []
        self.sender = Sender(
            self.tp,
            RankInfo("prefill", 0, 1, self.p_spec.addr),
            p_layout,
            Topology(4, 1),
            Peers(self.tp, dial_timeout_ns),
            on_write_finished=self.reports.append,
            guard=self.p_guard,
        )
        self.receiver = Receiver(
            RankInfo("decode", 0, 1, self.d_spec.addr),
            d_layout,
            Peers(self.td, dial_timeout_ns),
            recv_policy,
            clock=lambda: self.now,
            guard=self.d_guard,
        )
        self.delta = d_num_tokens_delta

    def expect(self, tid: str, n: int, blocks: tuple[int, ...]) -> None:
        self.receiver.on_event(
            expected_event(tid, [self.p_spec], self.d_spec, blocks, n + self.delta), self.now
        )

    def register(self, tid: str) -> m.Register:
        """D's registration of ``tid`` for block 1 (16 tokens), for a test to hand to P itself."""
        return m.Register(
            transfer_id=tid,
            d_engine_id="decode",
            d_rank=0,
            d_tp_size=1,
            d_addr=self.d_spec.addr,
            layout=self.receiver.layout,
            block_ids=((1,),),
            first_token=0,
            num_tokens=16,
            ttl_ms=10_000,
        )

    def pump(self, rounds: int = 20, dt_ns: int = MS) -> None:
        for _ in range(rounds):
            self.now += dt_ns
            for t, endpoint, guard in (
                (self.tp, self.sender, self.p_guard),
                (self.td, self.receiver, self.d_guard),
            ):
                for agent, frame in t.get_notifs():
                    if (msg := guard.decode(frame, agent)) is not None:
                        endpoint.on_message(agent, msg, self.now)
            self.sender.peers.poll(self.now)
            self.receiver.peers.poll(self.now)
            self.sender.poll(self.now)
            self.receiver.poll(self.now)


def test_happy_path_moves_the_bytes_and_reports_once() -> None:
    pair = Pair()
    pair.expect("t", 40, (9, 3, 5))
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1, 2, 3),), 40), pair.now)
    pair.pump()
    assert [(r.transfer_id, r.ok) for r in pair.receiver.finished] == [("t", True)]
    assert pair.sender.finished == ["preq"]
    assert np.count_nonzero(pair.d_buf[:, [9, 3]]) > 0 and not np.any(pair.d_buf[:, 0])
    (report,) = pair.reports
    # Per layer: one piece per full block (D's are scattered) and, for the half-filled last
    # block of this head-major layout, one per head.
    assert report.ok and report.descriptors == 2 * (2 + 4)
    assert report.issued_ns <= report.prepared_ns <= report.posted_ns <= report.done_ns


def test_post_error_fails_d_and_frees_p() -> None:
    pair = Pair()
    pair.fabric.fail_writes("post", count=1)
    pair.expect("t", 32, (1, 2))
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1, 2),), 32), pair.now)
    pair.pump()
    assert pair.sender.finished == ["preq"]
    (got,) = pair.receiver.finished
    assert not got.ok and got.reason is m.FailReason.POST_ERROR
    assert not np.any(pair.d_buf)


def test_token_count_mismatch_is_a_layout_failure() -> None:
    pair = Pair(d_num_tokens_delta=16)
    pair.expect("t", 32, (1, 2, 3))
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1, 2),), 32), pair.now)
    pair.pump()
    assert pair.sender.finished == ["preq"]
    assert pair.receiver.finished[0].reason is m.FailReason.LAYOUT_MISMATCH


@pytest.mark.parametrize(
    ("p_dtype", "d_dtype"),
    [("fp8_e4m3", "fp8_e5m2"), ("bfloat16", "fp8"), ("fp8", "")],  # "": an older D
)
def test_different_kv_dtypes_are_refused_not_written(
    p_dtype: str, d_dtype: str, caplog: pytest.LogCaptureFixture
) -> None:
    """fp8_e4m3 and fp8_e5m2 have the same token_bytes: only the dtype names tell them
    apart, and P must refuse the registration rather than write bytes D would misread."""
    pair = Pair()
    pair.sender.layout = msgspec.structs.replace(pair.sender.layout, dtype=p_dtype)
    pair.receiver.layout = msgspec.structs.replace(pair.receiver.layout, dtype=d_dtype)
    pair.expect("t", 32, (1, 2))
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1, 2),), 32), pair.now)
    pair.pump()
    assert pair.sender.finished == ["preq"] and pair.fabric.posted == []
    (got,) = pair.receiver.finished
    assert not got.ok and got.reason is m.FailReason.LAYOUT_MISMATCH
    assert not np.any(pair.d_buf)
    assert f"KV dtypes differ: P stores {p_dtype}" in caplog.text


def test_a_registration_with_an_invalid_layout_fails_the_transfer_not_the_thread(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pair = Pair()
    reg = pair.register("t")
    first = reg.layout.regions[0]
    overlapping = msgspec.structs.replace(
        reg.layout, regions=(first, msgspec.structs.replace(first, layer=1))
    )  # two layers on the same bytes: validate() refuses it
    pair.sender.on_message(
        pair.d_spec.agent, msgspec.structs.replace(reg, layout=overlapping), pair.now
    )
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1,),), 16), pair.now)
    pair.pump()
    assert pair.sender.finished == ["preq"] and pair.fabric.posted == []
    assert "t cannot be mapped: regions (0, 0, 0) and (1, 0, 0) overlap" in caplog.text


def test_write_waits_for_the_compute_step() -> None:
    pair = Pair()
    done = {"v": False}
    pair.expect("t", 16, (4,))
    pair.sender.on_event(
        ev.PrefillDone("t", "preq", ((1,),), 16), pair.now, ready=lambda: done["v"]
    )
    pair.pump()
    assert pair.fabric.posted == [] and pair.receiver.finished == []
    done["v"] = True
    pair.pump()
    assert len(pair.fabric.posted) == 1 and pair.receiver.finished[0].ok


def test_a_transfer_is_one_record_whose_phase_follows_its_write() -> None:
    """The ready check makes a record; the WRITE, issued before the KV is computed, is
    deferred, then written; the record goes with the blocks."""
    pair = Pair()
    done = {"v": False}
    phases: list[Phase | None] = []

    def phase() -> None:
        rec = pair.sender._transfers.get("t")
        phases.append(rec.phase if rec is not None else None)

    pair.sender.on_event(
        ev.PrefillDone("t", "preq", ((1,),), 16), pair.now, ready=lambda: done["v"]
    )
    phase()
    pair.expect("t", 16, (4,))
    pair.pump()
    phase()
    assert pair.sender.writes_in_flight() == 1 and not pair.sender.quiescent(["t"])
    done["v"] = True
    pair.pump()
    phase()
    assert phases == [Phase.COMPUTING, Phase.DEFERRED, None]
    assert pair.sender.writes_in_flight() == 0 and pair.sender.quiescent(["t"])
    assert pair.sender.finished == ["preq"] and pair.receiver.finished[0].ok


def test_registration_tells_p_ds_deadline_and_write_bound() -> None:
    pair = Pair(recv_policy=ReceiverPolicy(timeout_ns=400 * MS, write_timeout_ns=70 * MS))
    pair.expect("t", 16, (4,))
    pair.pump(rounds=5)
    rec = pair.sender.table.get("t")
    assert rec is not None and rec.write_bound_ns == 70 * MS
    d_rec = pair.receiver.table.get("t")
    assert d_rec is not None
    # ttl_ms was what was left of D's wait when sent: P's bound is D's deadline, plus the
    # (fake) wire's delay.
    assert rec.post_by_ns is not None and d_rec.expires_ns <= rec.post_by_ns
    assert rec.post_by_ns - d_rec.expires_ns <= 5 * MS


def test_a_write_whose_kv_is_late_past_its_deadline_is_never_posted() -> None:
    pair = Pair(recv_policy=ReceiverPolicy(timeout_ns=400 * MS, write_timeout_ns=5 * MS))
    pair.expect("t", 16, (4,))
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1,),), 16), pair.now, ready=lambda: False)
    pair.pump(rounds=20)
    assert pair.fabric.posted == []
    (got,) = pair.receiver.finished
    assert not got.ok and got.reason is m.FailReason.WRITE_TIMEOUT
    assert pair.sender.finished == ["preq"]


def test_a_registration_due_past_ds_deadline_is_not_sent_and_fails_the_load() -> None:
    # The dial to P outlasts D's receive deadline: a registration sent now would let P
    # write after D's bound, so it is not sent, and the load fails at once.
    pair = Pair(recv_policy=ReceiverPolicy(timeout_ns=5 * MS, write_timeout_ns=2 * MS))
    pair.expect("t", 16, (4,))
    pair.pump(rounds=5, dt_ns=20 * MS)
    (got,) = pair.receiver.finished
    assert not got.ok and got.reason is m.FailReason.DEADLINE
    assert pair.sender.table.get("t") is None, "P must never hear of it"
    assert pair.receiver.counters["send_failed"] == 1


def test_a_message_built_too_late_is_not_sent() -> None:
    pair = Pair()
    failed: list = []
    pair.receiver.peers.send(pair.p_spec.addr, lambda: None, pair.now, failed.append)
    pair.pump(rounds=5)
    assert len(failed) == 1 and isinstance(failed[0], NotSent)
    assert pair.tp.get_notifs() == []


def test_unreachable_decode_fails_the_dial_and_frees_blocks() -> None:
    pair = Pair()
    pair.fabric.set_unreachable(pair.d_spec.agent)
    pair.sender.on_message(pair.d_spec.agent, pair.register("t"), pair.now)
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1,),), 16), pair.now)
    pair.pump(rounds=100)
    assert pair.sender.finished == ["preq"]
    assert pair.reports[0].reason is m.FailReason.HANDSHAKE


def test_spoofed_sender_is_dropped() -> None:
    pair = Pair()
    pair.sender.on_message("someone-else", pair.register("t"), pair.now)
    assert pair.sender.counters["sender_mismatch"] == 1 and len(pair.sender.table) == 0
    pair.receiver.on_event(expected_event("u", [pair.p_spec], pair.d_spec, (1,), 16), pair.now)
    pair.receiver.on_message(
        "someone-else", m.Completion(transfer_id="u", p_rank=0, p_tp_size=1), pair.now
    )
    assert pair.receiver.counters["sender_mismatch"] == 1 and pair.receiver.finished == []


@pytest.mark.parametrize(
    "frame, counter",
    [
        (b"PUSH_REG:whatever", "foreign_notifs"),
        (m.MAGIC + b"\x93\x01", "malformed_notifs"),
        (m.encode(m.Completion(transfer_id="x", p_rank=0, p_tp_size=1)), "misrouted_notifs"),
    ],
)
def test_transfer_thread_drops_and_counts_bad_frames(frame: bytes, counter: str) -> None:
    pair = Pair()
    thread = TransferThread(pair.tp, pair.sender.peers, sender=pair.sender)  # not started
    thread._dispatch_frame("decode-0", frame, 0)
    assert thread.counters[counter] == 1
