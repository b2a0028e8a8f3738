"""The transfer thread's codec with a secret (connector/transfer/guard.py): P and D over
the fake fabric with matching and mismatched secrets, forged notifications dropped by
the thread, and sealed doorbells on real UDP sockets."""

from __future__ import annotations

import logging
import socket
import time

import numpy as np
import pytest

from connector.core import events as ev
from connector.core import messages as m
from connector.transfer.doorbell import MESSAGE, WRITE, Doorbell, write_key
from connector.transfer.guard import Guard
from connector.transfer.thread import TransferThread
from tests.unit.test_endpoints import Pair

KEY = b"k" * 32
OTHER = b"o" * 32
BOUND_S = 5.0


def test_matching_secrets_push_as_before() -> None:
    pair = Pair(guards=(Guard(KEY), Guard(KEY)))
    pair.expect("t", 32, (4, 5))
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1, 2),), 32), pair.now)
    pair.pump()
    assert [(r.transfer_id, r.ok) for r in pair.receiver.finished] == [("t", True)]
    assert np.count_nonzero(pair.d_buf[:, [4, 5]]) > 0
    assert not pair.p_guard.counters and not pair.d_guard.counters


@pytest.mark.parametrize(
    "p_key, d_key, p_refused",
    [(KEY, OTHER, "auth_bad_tag"), (KEY, None, "auth_missing"), (None, KEY, "auth_unexpected")],
)
def test_mismatched_secrets_never_write_and_count_the_refusals(
    p_key: bytes | None, d_key: bytes | None, p_refused: str
) -> None:
    pair = Pair(guards=(Guard(p_key), Guard(d_key)))
    pair.expect("t", 32, (4, 5))
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1, 2),), 32), pair.now)
    pair.pump()
    assert pair.p_guard.counters[p_refused] == 1  # D's registration
    assert pair.sender.table.get("t") is not None and not pair.reports  # nothing written
    assert not np.any(pair.d_buf)


def test_a_replayed_notification_is_refused() -> None:
    sender, receiver = Guard(KEY), Guard(KEY)
    frame = sender.encode(m.Fail(transfer_id="t", p_rank=0, reason=m.FailReason.CANCELLED))
    assert receiver.decode(frame, "p") is not None
    assert receiver.decode(frame, "p") is None
    assert receiver.counters == {"auth_replayed": 1}


def test_stale_notifications_are_refused() -> None:
    now = [1_000_000]
    sender, receiver = Guard(KEY, clock_ms=lambda: now[0]), Guard(KEY, 10.0, lambda: now[0])
    frame = sender.encode(m.Fail(transfer_id="t", p_rank=0, reason=m.FailReason.CANCELLED))
    now[0] += 10_001
    assert receiver.decode(frame, "p") is None and receiver.counters == {"auth_stale": 1}


def test_refusals_are_logged_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    guard = Guard(KEY)
    plain = m.encode(m.Fail(transfer_id="t", p_rank=0, reason=m.FailReason.CANCELLED))
    with caplog.at_level(logging.WARNING, "connector.transfer.guard"):
        for _ in range(9):
            assert guard.decode(plain, "intruder") is None
    assert guard.counters["auth_missing"] == 9
    assert len(caplog.records) == 4  # the 1st, 2nd, 4th and 8th
    assert "intruder" in caplog.records[0].getMessage()


def test_the_thread_drops_a_forged_registration() -> None:
    pair = Pair(guards=(Guard(KEY), Guard(KEY)))
    thread = TransferThread(pair.tp, pair.sender.peers, sender=pair.sender, guard=pair.p_guard)
    forged = m.encode(pair.register("t"))  # a registration without the secret
    thread._dispatch_frame(pair.d_spec.agent, forged, 0)
    thread._dispatch_frame(pair.d_spec.agent, Guard(OTHER).encode(pair.register("t")), 0)
    assert thread.counters["unauthenticated_notifs"] == 2
    assert pair.p_guard.counters == {"auth_missing": 1, "auth_bad_tag": 1}
    assert len(pair.sender.table) == 0  # never taken as D's
    thread._dispatch_frame(pair.d_spec.agent, Guard(KEY).encode(pair.register("t")), 0)
    assert len(pair.sender.table) == 1


def _udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sealed_bells_ring_and_forged_ones_are_ignored() -> None:
    a = Doorbell("127.0.0.1", _udp_port(), Guard(KEY))
    b = Doorbell("127.0.0.1", _udp_port(), Guard(KEY))
    rogue = Doorbell("127.0.0.1", _udp_port())  # no secret
    try:
        rogue.ring(*b.address, WRITE + write_key(0, "t"))
        other = Doorbell("127.0.0.1", _udp_port(), Guard(OTHER))
        other.ring(*b.address, MESSAGE)
        other.close()
        a.ring(*b.address, WRITE + write_key(0, "t"))
        got: list[bytes] = []
        deadline = time.monotonic() + BOUND_S
        while not got and time.monotonic() < deadline:
            got = b.wait(BOUND_S).writes
        assert got == [write_key(0, "t")]
        assert b.heard_from(*a.address) and not b.heard_from(*rogue.address)
        assert b.counters["refused"] == 2
    finally:
        for bell in (a, b, rogue):
            bell.close()
