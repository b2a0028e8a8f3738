"""Test-only fault injection on a real engine: ``FaultyTransport`` wraps a rank's transport.

Owns: failing a WRITE's post (P) and losing a transfer's first ``done`` notification (D),
for transfers whose prompt has a chosen number of tokens (the registration says it), so a
test picks the faulty request by its prompt. Configured by ``kv_connector_extra_config``'s
``_faults`` (``connector.config.Faults``, docs/operations.md#fault-injection-test-only);
absent by default, when nothing is wrapped and nothing costs. Never for production.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np

from connector.config import Faults
from connector.core import messages as m
from connector.core.errors import RemoteProtocolError, TransportError
from connector.transport.base import WriteHandle
from telemetry.schema import Count

logger = logging.getLogger(__name__)


def _decode(frame: bytes) -> m.Message | None:
    if not m.is_frame(frame):
        return None
    try:
        return m.decode(frame)
    except RemoteProtocolError:
        return None  # the transfer thread drops and counts it


class FaultyTransport:
    """Every Transport member passes through to ``inner``; ``write``, ``send_notif`` and
    ``get_notifs`` first apply ``faults``."""

    def __init__(self, inner: Any, faults: Faults) -> None:
        self._inner, self._faults = inner, faults
        self._fail_write: set[str] = set()  # P: transfer ids whose WRITE post fails
        self._drop_done: set[str] = set()  # D: transfer ids whose first `done` is lost
        self.counters: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _injected(self, kind: str, tid: str) -> None:
        self.counters[f"{Count.INJECTED.value}{kind}"] += 1
        logger.warning("pushkv test fault injected: %s (transfer %s)", kind, tid)

    def send_notif(self, peer: str, msg: bytes) -> None:
        tokens = self._faults.drop_completion_tokens
        if tokens:
            reg = _decode(msg)
            if isinstance(reg, m.Register) and reg.num_tokens == tokens:
                self._drop_done.add(reg.transfer_id)
        self._inner.send_notif(peer, msg)

    def get_notifs(self) -> list[tuple[str, bytes]]:
        out = []
        for agent, frame in self._inner.get_notifs():
            msg = _decode(frame)
            if isinstance(msg, m.Register) and msg.num_tokens == self._faults.fail_write_tokens:
                self._fail_write.add(msg.transfer_id)
            if isinstance(msg, m.Completion) and msg.transfer_id in self._drop_done:
                self._drop_done.discard(msg.transfer_id)  # only the first: a resend gets in
                self._injected("drop_completion", msg.transfer_id)
                continue
            out.append((agent, frame))
        return out

    def write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, notif: bytes, **mem: str
    ) -> WriteHandle:
        done = _decode(notif)  # the WRITE's own `done` names its transfer
        if done is not None and done.transfer_id in self._fail_write:
            self._fail_write.discard(done.transfer_id)
            self._injected("fail_write", done.transfer_id)
            raise TransportError("injected WRITE failure (test-only _faults)")
        handle: WriteHandle = self._inner.write(peer, src, dst, notif, **mem)
        return handle
