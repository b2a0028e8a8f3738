"""How the connector learns that its engine is shutting down, before vLLM says so.

Owns: ``ShutdownWatch``. vLLM tells a connector nothing between SIGTERM and its ``shutdown``
hook, which runs only once EngineCore's loop has ended: with ``--shutdown-timeout N > 0``
after it drained the requests in flight (up to N s, then SIGKILL); with 0 it aborts them and
the API server SIGKILLs EngineCore at once, so no hook of ours runs at all. The watch chains
vLLM's own SIGTERM and SIGINT handlers in EngineCore, where the scheduler role runs; the
scheduler role arms it on its first step (vLLM 0.26 installs its handlers after building the
engine, 0.32 before) and hands the grace left to the workers in each step's plan, whose
transfer threads then end what still waits (``TransferThread.begin_shutdown``).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

Handler = Callable[[int, FrameType | None], Any]


class ShutdownWatch:
    def __init__(
        self,
        grace_s: float,
        engine_timeout_s: float = 0.0,
        signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
    ) -> None:
        """``grace_s``: how long after the signal a transfer may still wait (the config's
        ``shutdown_grace_s``); at most half of vLLM's ``--shutdown-timeout``
        (``engine_timeout_s``, when above 0), so what D then recomputes still ends in it."""
        self.grace_s = grace_s if engine_timeout_s <= 0 else min(grace_s, engine_timeout_s / 2)
        self.requested_ns: int | None = None
        self._signals = tuple(signals)
        self._armed = False

    def arm(self) -> bool:
        """Chain each signal's current handler, once. Only from the main thread (Python
        sets handlers there only), and only over a Python handler (vLLM's): a default or
        ignored disposition stays as it is, since how the process dies is not ours to
        change. True once armed (or found nothing to chain)."""
        if self._armed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in self._signals:
            prev = signal.getsignal(sig)
            if callable(prev):
                signal.signal(sig, self._chained(prev))
        self._armed = True
        return True

    def _chained(self, prev: Handler) -> Handler:
        def handler(signum: int, frame: FrameType | None) -> Any:
            if self.requested_ns is None:  # no logging here: a signal handler
                self.requested_ns = time.monotonic_ns()
            return prev(signum, frame)

        return handler

    def grace_left_s(self, now_ns: int | None = None) -> float | None:
        """None while the engine runs; once signalled, the grace still left (0 when past)."""
        if self.requested_ns is None:
            return None
        now = time.monotonic_ns() if now_ns is None else now_ns
        return max(0.0, self.grace_s - (now - self.requested_ns) / 1e9)
