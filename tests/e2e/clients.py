"""Clients that keep a stack busy while an e2e test breaks or restarts part of it.

``Load``: ``clients`` threads, each sending one request after another until the ``with``
block ends; ``send(client, k, i)`` sends client ``k``'s ``i``-th request and returns its
answer (anything with a ``started`` time). ``wait_until``: a bounded poll that fails the test
naming what it waited for; ``wait_restarted``: the same for a restarted server's /health,
failing at once if its process exits. ``http_client``: loopback, no proxies.
``concurrently``: calls in threads of their own, all waited for (the servers' warm-ups).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

import httpx
import pytest

from connector.tools.stack import VllmServer, first_traceback


class _Timed(Protocol):
    @property
    def started(self) -> float: ...


A = TypeVar("A", bound=_Timed)


def http_client(url: str, timeout_s: float) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=timeout_s, trust_env=False)


def concurrently(*calls: Callable[[], object]) -> None:
    """Run each of ``calls`` in a thread of its own and wait for all; the first one's error
    (in the order given) is raised. A fresh server's first request takes seconds of its own
    core's time: servers on other cores take theirs meanwhile."""
    with concurrent.futures.ThreadPoolExecutor(max(1, len(calls))) as pool:
        futures = [pool.submit(call) for call in calls]
    for future in futures:
        future.result()


def wait_until(
    what: str, pred: Callable[[], object], timeout_s: float, poll_s: float = 0.05
) -> float:
    """The time at which ``pred()`` first held; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not seen within {timeout_s:.0f} s")
        time.sleep(poll_s)  # pacing of the poll, not synchronisation
    return time.monotonic()


def wait_restarted(what: str, server: VllmServer, timeout_s: float) -> float:
    """The time at which the restarted ``server`` first answered /health 200 (polled as
    often as ``wait_until`` does, so a test can bound what follows); fails at once, with
    its log's first traceback, if the process exits first."""

    def healthy() -> bool:
        if not server.is_running():
            first = first_traceback(server.log_path) if server.log_path else ""
            pytest.fail(
                f"{what} exited before it was healthy; last lines of {server.log_path}:\n"
                f"{server.log_tail(40)}" + (f"\nits first traceback:\n{first}" if first else "")
            )
        try:
            r = httpx.get(f"{server.url}/health", timeout=1.0, trust_env=False)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    return wait_until(f"{what}'s /health", healthy, timeout_s)


class Load(Generic[A]):
    """``clients`` threads, each sending one request after another until stopped; none
    starts one while ``paused``."""

    def __init__(
        self,
        url: str,
        clients: int,
        send: Callable[[httpx.Client, int, int], A],
        timeout_s: float,
    ) -> None:
        self.url, self._send, self._timeout_s = url, send, timeout_s
        self.answers: list[A] = []
        self._stop = threading.Event()
        self._go = threading.Event()  # cleared while paused; set again to stop
        self._go.set()
        self._threads = [
            threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(clients)
        ]

    def _client(self, k: int) -> None:
        with http_client(self.url, self._timeout_s) as c:
            i = 0
            while self._go.wait() and not self._stop.is_set():
                i += 1
                self.answers.append(self._send(c, k, i))

    def __enter__(self) -> Load[A]:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._go.set()
        for t in self._threads:
            t.join(self._timeout_s + 10)
        assert not any(t.is_alive() for t in self._threads), "a client never returned"

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No client starts a request in the block (those in flight end as usual)."""
        self._go.clear()
        try:
            yield
        finally:
            self._go.set()

    def count(self, since: float = 0.0) -> int:
        return sum(1 for a in list(self.answers) if a.started >= since)
