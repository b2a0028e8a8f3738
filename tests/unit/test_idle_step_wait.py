"""An engine step with nothing to compute waits (briefly) for a transfer result instead of
returning at once (PushkvConfig.idle_step_wait_s): the transfer thread's result signal and
the worker's decision when to wait."""

from __future__ import annotations

import time
from collections import Counter

from connector.config import PushkvConfig
from connector.core import events as ev
from connector.metadata import StepPlan
from connector.transfer.thread import TransferThread
from connector.worker_side import WorkerSide
from tests.unit.test_endpoints import Pair

BOUND_S = 10.0  # generous: a result on the fake fabric takes milliseconds


def test_result_signal_is_set_when_a_result_is_ready_and_cleared_when_taken() -> None:
    pair = Pair()
    p = TransferThread(pair.tp, pair.sender.peers, sender=pair.sender, name="p")
    d = TransferThread(pair.td, pair.receiver.peers, receiver=pair.receiver, name="d")
    p.start()
    d.start()
    try:
        assert not d.wait_for_results(0.01), "no transfer yet, no result"
        from connector.tools.loopback import expected_event

        d.submit(expected_event("t", [pair.p_spec], pair.d_spec, (1, 2), 32))
        assert d.transfers_pending
        p.submit(ev.PrefillDone("t", "preq", ((1, 2),), 32))
        t0 = time.monotonic()
        assert d.wait_for_results(BOUND_S), f"D had no result after {BOUND_S} s"
        assert time.monotonic() - t0 < BOUND_S
        (got,) = d.take_finished_recving()
        assert got.ok
        assert not d.wait_for_results(0.01), "taken: the signal is cleared"
        assert p.wait_for_results(BOUND_S) and p.take_finished_sending() == ["preq"]
    finally:
        p.stop()
        d.stop()


class FakeThread:
    def __init__(self, pending: bool) -> None:
        self.transfers_pending = pending
        self.waits: list[float] = []
        self.counters: Counter[str] = Counter()

    def wait_for_results(self, timeout_s: float) -> bool:
        self.waits.append(timeout_s)
        return False

    def take_finished_sending(self) -> list[str]:
        return []

    def take_finished_recving(self) -> list:
        return []


def worker(
    wait_s: float, pending: bool, idle: bool, elsewhere: bool = False
) -> tuple[WorkerSide, FakeThread]:
    """``pending``: this rank's transfer thread has a transfer in progress; ``elsewhere``:
    the step's plan says one is in progress on some rank."""
    w = WorkerSide(PushkvConfig(idle_step_wait_s=wait_s), "e", True, True, 0, 1, 4, 16, {})
    w.thread = FakeThread(pending)  # type: ignore[assignment]
    w._plan = StepPlan(idle=idle, transfers_pending=elsewhere)  # what bind() keeps
    return w, w.thread  # type: ignore[return-value]


def test_worker_waits_only_on_idle_steps_with_a_transfer_pending() -> None:
    for wait_s, pending, idle, elsewhere, expect in (
        (0.005, True, True, True, [0.005]),
        (0.005, True, False, True, []),  # a forward ran
        (0.005, False, True, False, []),  # nothing to wait for
        (0.0, True, True, True, []),  # turned off
        # MLA's P rank 1 while rank 0 pushes: returning at once, it would spin in vLLM's
        # message queue for the next step, a core that D may share
        (0.005, False, True, True, [0.005]),
        (0.005, False, False, True, []),
    ):
        w, fake = worker(wait_s, pending, idle, elsewhere)
        assert w.take_results() == (set(), set(), set())
        assert fake.waits == expect, (wait_s, pending, idle, elsewhere)
