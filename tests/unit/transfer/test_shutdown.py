"""P and D shutting down: WRITEs already posted or ready finish; every transfer
still waiting ends with reason ``shutdown``, its peer told at once; no block is written
after it was handed back, none is kept.

Endpoints over the in-process fake transport, pumped by hand (``tests/unit/test_endpoints``'s
``Pair``); the transfer thread's ``begin_shutdown`` and ``drain`` on a real thread; the
engine's signal watch (``connector/shutdown.py``) with a signal of its own.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from connector.core import events as ev
from connector.core import messages as m
from connector.core.sender_table import SenderTable
from connector.core.state import SendState
from connector.shutdown import ShutdownWatch
from connector.transfer.thread import TransferThread, _Close
from tests.unit.core.factories import register
from tests.unit.test_endpoints import MS, Pair

SHUTDOWN = m.FailReason.SHUTDOWN


def _reasons(pair: Pair) -> list[tuple[str, bool, m.FailReason | None]]:
    return [(r.transfer_id, r.ok, r.reason) for r in pair.receiver.finished]


# ------------------------------------------------------------------ the table (pure)
def test_the_table_ends_what_waits_and_leaves_a_write_in_flight_alone() -> None:
    t = SenderTable(lambda d_tp: frozenset(range(d_tp)))
    t.handle(ev.Registered(register("reg")), 0)  # D waits, no prefill yet
    t.handle(ev.PrefillDone("pre", "req-pre", ((1, 2),), 32), 0)  # blocks held, no D yet
    t.handle(ev.Registered(register("w")), 0)
    (issue,) = t.handle(ev.PrefillDone("w", "req-w", ((3,),), 48), 0)
    assert isinstance(issue, ev.IssueWrite)

    out = t.shut_down(1)
    assert ev.FreeBlocks("pre", "req-pre") in out
    fails = {a.transfer_id: a for a in out if isinstance(a, ev.SendFail)}
    assert set(fails) == {"reg"} and fails["reg"].reason is SHUTDOWN
    assert not any(isinstance(a, ev.FreeBlocks) and a.transfer_id == "w" for a in out)
    assert t.get("w").state is SendState.WRITING and not t.settled()  # type: ignore[union-attr]
    assert t.shut_down(2) == []  # nothing new: nothing to do

    assert t.handle(ev.WriteDone("w"), 3) == [ev.FreeBlocks("w", "req-w")]
    assert t.settled() and t.holding_blocks() == 0
    # What comes later ends at the next poll: a prefill for the ended registration hands
    # its blocks straight back; a new registration is failed, not kept.
    assert t.handle(ev.PrefillDone("reg", "req-reg", ((4,),), 48), 4) == [
        ev.FreeBlocks("reg", "req-reg")
    ]
    t.handle(ev.Registered(register("late")), 5)
    (late,) = t.shut_down(5)
    assert isinstance(late, ev.SendFail) and late.reason is SHUTDOWN
    assert t.settled() and t.holding_blocks() == 0


# ------------------------------------------------------------------ P and D endpoints
def test_p_finishes_a_write_whose_kv_was_not_ready_yet() -> None:
    pair = Pair()
    ready = {"v": False}
    pair.expect("t", 16, (4,))
    pair.sender.on_event(
        ev.PrefillDone("t", "preq", ((1,),), 16), pair.now, ready=lambda: ready["v"]
    )
    pair.pump()
    assert pair.fabric.posted == []  # deferred: the compute step has not finished
    pair.sender.shut_down(pair.now)
    ready["v"] = True
    pair.pump()
    assert _reasons(pair) == [("t", True, None)] and pair.sender.finished == ["preq"]
    assert np.any(pair.d_buf[:, 4])


def test_p_hands_back_blocks_no_d_asked_for_and_fails_the_late_registration() -> None:
    pair = Pair()
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1,),), 16), pair.now)
    pair.sender.shut_down(pair.now)
    assert pair.sender.finished == ["preq"]  # back to vLLM at once, not at the lease
    pair.expect("t", 16, (4,))
    pair.pump()
    assert _reasons(pair) == [("t", False, SHUTDOWN)]
    assert pair.fabric.posted == [] and not np.any(pair.d_buf)


def test_p_tells_a_waiting_d_at_once_and_returns_the_prefill_that_comes_later() -> None:
    pair = Pair()
    pair.expect("t", 16, (4,))
    pair.pump()  # D's registration is in: P waits for its prefill
    pair.sender.shut_down(pair.now)
    pair.pump(rounds=3)
    assert _reasons(pair) == [("t", False, SHUTDOWN)]
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1,),), 16), pair.now)
    pair.pump()
    assert pair.sender.finished == ["preq"] and pair.fabric.posted == []
    assert not np.any(pair.d_buf)


def test_d_cancels_what_it_awaits_and_reports_only_once_p_answered() -> None:
    pair = Pair()
    pair.expect("t", 16, (4,))
    pair.pump()  # registered at P, whose prefill has not finished
    pair.receiver.shut_down(pair.now)
    assert pair.receiver.finished == []  # not before P said it will not write
    pair.pump(rounds=3)
    assert _reasons(pair) == [("t", False, SHUTDOWN)]
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1,),), 16), pair.now)
    pair.pump()
    assert pair.sender.finished == ["preq"]  # P's blocks back, nothing written to D
    assert pair.fabric.posted == [] and not np.any(pair.d_buf)


# ------------------------------------------------------------------ the transfer thread
def _p_thread(pair: Pair, frozen: bool = False) -> TransferThread:
    """P's thread on the pair's transport; ``frozen``: on the pair's clock (the time of its
    last ``pump``), so records the pump made do not expire on the thread's clock."""
    clock = (lambda: pair.now) if frozen else time.monotonic_ns
    thread = TransferThread(pair.tp, pair.sender.peers, sender=pair.sender, clock=clock)
    thread.start()
    return thread


def test_begin_shutdown_ends_waiting_transfers_after_the_grace_not_before() -> None:
    pair = Pair()
    thread = _p_thread(pair)
    try:
        thread.submit(ev.PrefillDone("t", "preq", ((1,),), 16))  # no D will register
        t0 = time.monotonic()
        thread.begin_shutdown(0.3)
        assert thread.wait_for_results(5.0), "blocks never handed back after the grace"
        took = time.monotonic() - t0
        assert thread.take_finished_sending() == ["preq"]
        assert 0.25 <= took < 3.0, f"handed back {took:.2f} s after the signal (grace 0.3 s)"
    finally:
        thread.stop()


def test_drain_returns_once_settled_and_at_its_timeout_while_a_write_runs() -> None:
    pair = Pair()
    thread = _p_thread(pair)
    try:
        thread.submit(ev.PrefillDone("t", "preq", ((1,),), 16))
        assert thread.drain(5.0), "nothing was in flight: drain must settle"
        assert thread.take_finished_sending() == ["preq"] and thread.closing
    finally:
        thread.stop()

    pair = Pair()
    pair.fabric.delay_writes(10**9)  # the WRITE never ends on its own
    pair.expect("w", 16, (4,))
    pair.pump()  # D's registration is in
    thread = _p_thread(pair, frozen=True)
    try:
        thread.submit(ev.PrefillDone("w", "wreq", ((1,),), 16))
        t0 = time.monotonic()
        assert not thread.drain(0.3), "drain settled with a WRITE in flight"
        assert time.monotonic() - t0 < 3.0
        assert len(pair.fabric.posted) == 1 and thread.take_finished_sending() == []
    finally:
        thread.stop()


# ------------------------------------------------------------------ the engine's signal
@pytest.fixture
def usr1() -> object:
    prev = signal.getsignal(signal.SIGUSR1)
    yield prev
    signal.signal(signal.SIGUSR1, prev)


def test_the_watch_chains_the_engines_handler_and_counts_the_grace(usr1: object) -> None:
    seen: list[int] = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    watch = ShutdownWatch(2.0, engine_timeout_s=3.0, signals=(signal.SIGUSR1,))
    assert watch.grace_s == 1.5  # half of vLLM's --shutdown-timeout, when shorter
    assert watch.arm() and watch.grace_left_s() is None
    os.kill(os.getpid(), signal.SIGUSR1)
    assert seen == [signal.SIGUSR1]  # vLLM's own handler still runs
    assert watch.requested_ns is not None
    assert watch.grace_left_s(watch.requested_ns + 1_000 * MS) == pytest.approx(0.5)
    assert watch.grace_left_s(watch.requested_ns + 9_000 * MS) == 0.0


def test_the_watch_leaves_a_default_disposition_and_other_threads_alone(usr1: object) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    watch = ShutdownWatch(2.0, signals=(signal.SIGUSR1,))
    got: list[bool] = []
    worker = threading.Thread(target=lambda: got.append(watch.arm()))
    worker.start()
    worker.join(5.0)
    assert got == [False]  # only the main thread may set handlers: try again later
    assert watch.arm() and signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    assert watch.grace_s == 2.0


# ------------------------------------------------------------------ the engine's hooks
class _Thread:
    """The worker's transfer thread, as far as bind() uses it."""

    def __init__(self) -> None:
        self.closing: list[float] = []

    def begin_shutdown(self, grace_s: float) -> None:
        self.closing.append(grace_s)

    def submit(self, *a: object, **kw: object) -> None:
        pass


def test_the_plan_carries_the_grace_once_signalled_and_the_worker_tells_its_thread_once() -> None:
    from connector.config import PushkvConfig
    from connector.scheduler_side import SchedulerSide
    from connector.worker_side import WorkerSide
    from tests.unit.test_scheduler_side import Manager, SchedOut

    watch = ShutdownWatch(2.0, signals=())
    sched = SchedulerSide("prefill", is_producer=True, is_consumer=False, shutdown=watch)
    sched.bind_kv_cache_manager(Manager())
    assert sched.build_connector_meta(SchedOut({})).shutdown_grace_s is None
    watch.requested_ns = time.monotonic_ns()  # what the chained handler records
    plans = [sched.build_connector_meta(SchedOut({})) for _ in range(2)]
    assert all(p.shutdown_grace_s is not None and 0 < p.shutdown_grace_s <= 2.0 for p in plans)

    worker = WorkerSide(PushkvConfig(), "prefill", True, False, 0, 1, 4, 16, {})
    fake = _Thread()
    worker.thread = fake  # type: ignore[assignment]
    for plan in plans:
        worker.bind(plan)
    assert len(fake.closing) == 1 and 0 < fake.closing[0] <= 2.0


def test_the_thread_wakes_for_the_grace_and_does_not_spin_once_it_passed() -> None:
    pair = Pair()
    now = {"ns": 10**12}
    thread = TransferThread(
        pair.tp, pair.sender.peers, sender=pair.sender, clock=lambda: now["ns"]
    )  # not started: its loop is driven by hand
    thread._dispatch_event(_Close(200 * MS), None, None, now["ns"])
    assert thread._until_due(0.5) == pytest.approx(0.2)  # wakes when the grace ends
    now["ns"] += 300 * MS
    thread._step()
    assert thread.closing and thread._until_due(0.5) == 0.5  # an idle sleep, not a spin
