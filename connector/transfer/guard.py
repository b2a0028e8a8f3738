"""The transfer thread's codec for notifications and doorbells, sealed when a secret is set.

Owns: the secret at run time, the stamps (wall clock, nonces from a random prefix and a
counter), the replay window of incoming notifications, and the drop counters and
rate-limited log lines for what fails authentication. Without a secret it encodes and
decodes plain frames, as before. One transfer thread uses it; ``Doorbell`` seals its
rings with it.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import struct
import time
from collections.abc import Callable

from connector.core import auth
from connector.core import messages as m
from connector.core.errors import RemoteProtocolError
from telemetry.counts import Counts
from telemetry.schema import Count

logger = logging.getLogger(__name__)


class Guard:
    def __init__(
        self,
        key: bytes | None = None,
        window_s: float = 120.0,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        self.key = auth.check_key(key) if key is not None else None
        self._clock_ms = clock_ms
        self._window_ms = int(window_s * 1000)
        self._replay = auth.ReplayWindow(self._window_ms)
        self._prefix = secrets.token_bytes(8)  # unique per process; the counter per message
        self._seq = itertools.count()
        self.counters: Counts = Counts()

    @property
    def enabled(self) -> bool:
        return self.key is not None

    def stamp(self) -> auth.Stamp:
        return auth.Stamp(self._clock_ms(), self._prefix + struct.pack("!Q", next(self._seq)))

    def encode(self, msg: m.Message) -> bytes:
        if self.key is None:
            return m.encode(msg)
        return m.encode(msg, self.key, self.stamp())

    def decode(self, frame: bytes, sender: str) -> m.Message | None:
        """The message in ``frame``, or None when it fails authentication (counted under
        ``auth_<reason>``, logged rate-limited). Malformed frames still raise."""
        try:
            return m.decode(frame, self.key, now_ms=self._clock_ms(), replay=self._replay)
        except auth.AuthError as exc:
            self.refused(exc.reason, f"notification from {sender}", exc)
            return None

    def seal_bell(self, what: bytes) -> bytes:
        return what if self.key is None else auth.seal(self.key, auth.BELL, what, self.stamp())

    def open_bell(self, data: bytes) -> bytes | None:
        """A ring's payload, or None if it fails authentication. Bells skip the replay
        window: a replayed ring only costs a poll, and must not crowd out notifications."""
        if self.key is None:
            return data
        try:
            body, _ = auth.unseal(self.key, auth.BELL, data, self._clock_ms(), self._window_ms)
        except auth.AuthError as exc:
            self.refused(exc.reason, "doorbell", exc)
            return None
        return body

    def refused(self, reason: str, what: str, exc: RemoteProtocolError) -> None:
        """Count a refusal; log the 1st, 2nd, 4th, 8th... of each reason (a flood stays quiet)."""
        self.counters.add(Count.AUTH, reason)
        n = self.counters.of(Count.AUTH, reason)
        if n & (n - 1) == 0:
            logger.warning("Refused a %s: %s (%d so far)", what, exc, n)
