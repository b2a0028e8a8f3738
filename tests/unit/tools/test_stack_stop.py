"""``Stack.stop`` stops every service at once (each vLLM server takes seconds to shut down)
and still reaches every one when some stop fails."""

from __future__ import annotations

import threading

import pytest

from connector.tools.stack import ServerError, Stack


class _Svc:
    def __init__(self, barrier: threading.Barrier, fail: bool = False) -> None:
        self.barrier, self.fail, self.stopped = barrier, fail, False

    def start(self) -> None:
        pass

    def wait_healthy(self, timeout_s: float) -> None:
        pass

    def stop(self, timeout_s: float = 30.0) -> None:
        # Passes only if every service is inside stop() at the same time.
        self.barrier.wait(timeout=10.0)
        self.stopped = True
        if self.fail:
            raise RuntimeError("would not stop")


def test_services_stop_concurrently_and_once() -> None:
    barrier = threading.Barrier(3)
    services = [_Svc(barrier) for _ in range(3)]
    stack = Stack(services)
    stack.start()
    stack.stop()
    assert all(s.stopped for s in services)
    stack.stop()  # idempotent: nothing left to stop, no barrier to meet


def test_a_failed_stop_is_raised_after_every_service_stopped() -> None:
    barrier = threading.Barrier(3)
    services = [_Svc(barrier), _Svc(barrier, fail=True), _Svc(barrier)]
    stack = Stack(services)
    stack.start()
    with pytest.raises(ServerError, match="1 service"):
        stack.stop()
    assert all(s.stopped for s in services)
