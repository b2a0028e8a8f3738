"""The transfer thread's results, handed to the engine across threads.

Owns: ``Handback``, where the transfer thread puts the request ids whose blocks P gives
back and the loads D finished, and the engine takes them (``take_*``) or waits for some
(``wait``). The only state the two threads share besides the inbox, under one lock.
"""

from __future__ import annotations

import threading

from connector.transfer.receiver import Received


class Handback:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent: list[str] = []
        self._recvd: list[Received] = []
        self._ready = threading.Event()  # set while _sent or _recvd holds something

    def put(self, sent: list[str], recvd: list[Received]) -> None:
        """The transfer thread: these results are the engine's to take."""
        with self._lock:
            self._sent += sent
            self._recvd += recvd
            if self._sent or self._recvd:
                self._ready.set()

    def take_sent(self) -> list[str]:
        with self._lock:
            out, self._sent = self._sent, []
            if not self._recvd:
                self._ready.clear()
        return out

    def take_recvd(self) -> list[Received]:
        with self._lock:
            out, self._recvd = self._recvd, []
            if not self._sent:
                self._ready.clear()
        return out

    def wait(self, timeout_s: float) -> bool:
        """Block until a result is ready to take (True) or ``timeout_s`` passed."""
        return self._ready.wait(timeout_s)
