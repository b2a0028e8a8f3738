"""The transfer thread's plumbing with the OS: its name, its CPU mask, how it is woken.

Owns: ``name_os_thread`` and ``unpin`` (called once, first thing on the transfer thread)
and ``Waker``, what the thread sleeps on between polls: the doorbell
(``connector.transfer.doorbell``) where there is one, else ``EventWaker``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Protocol

from connector.transfer.doorbell import Rings

logger = logging.getLogger(__name__)


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in the kernel (``top -H``, ``/proc/*/task/*/comm``),
    so that its CPU shows apart from the engine's; Linux keeps the first 15 bytes. Threads
    it starts (a lazily created exporter's, UCX's) inherit the name."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: the name is cosmetic
        pass


def unpin() -> None:
    """Let this thread run on every CPU its server may use. vLLM's CPU worker pins its
    process (and so every thread it starts) to the cores of its OpenMP pool, where the
    engine loop spins; a transfer thread stuck behind it delays the WRITE and its
    notifications by seconds. The server's own mask (taskset, numactl, a cpuset: the
    operator's choice) is kept: it is read from the parent process (vLLM's EngineCore or
    API server, which vLLM does not pin). Widening past it would put D's thread on P's
    cores, where it slows P's prefills (``pushkv bench`` shows it in P's TTFT)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        allowed = os.sched_getaffinity(0)
        server = os.sched_getaffinity(os.getppid()) | allowed  # never narrower than now
        if server != allowed:
            os.sched_setaffinity(0, server)  # pid 0: the calling thread only
            logger.info(
                "Transfer thread moved from CPUs %s to %s",
                sorted(allowed),
                sorted(os.sched_getaffinity(0)),
            )
    except OSError as exc:  # a cpuset may forbid it, the parent may be gone: keep the mask
        logger.info("Transfer thread keeps its CPU mask: %s", exc)


class Waker(Protocol):
    def wake(self) -> None: ...
    def wait(self, timeout_s: float) -> Rings: ...


class EventWaker:
    """The waker without a doorbell: only the engine (submit, stop) wakes the thread."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def wake(self) -> None:
        self._event.set()

    def wait(self, timeout_s: float) -> Rings:
        if self._event.wait(timeout_s):
            self._event.clear()
            return Rings(True)
        return Rings(False)
