"""Every state transition of a transfer: P's table in send_state.py, D's in recv_state.py.

This module names both sides' public types for their callers (the transfer thread, the
config, the tests). Rule 1 (h11) holds per side: everything that changes a transfer's state
lives in that side's one file; what both share (``DeadlinePassed``, the out-of-turn rule) is
in transition.py. The scheduler's per-request states are a separate table, lifecycle.py.
"""

from __future__ import annotations

from connector.core.recv_state import (
    RECV_TABLE,
    ReceiverPolicy,
    RecvCtx,
    RecvRecord,
    RecvState,
    RecvTransition,
    SourceState,
    recv_transition,
)
from connector.core.send_state import (
    SEND_NEW,
    SEND_TABLE,
    SendCtx,
    SenderPolicy,
    SendRecord,
    SendState,
    SendTransition,
    send_transition,
)
from connector.core.transition import DeadlinePassed

__all__ = [
    "RECV_TABLE",
    "SEND_NEW",
    "SEND_TABLE",
    "DeadlinePassed",
    "ReceiverPolicy",
    "RecvCtx",
    "RecvRecord",
    "RecvState",
    "RecvTransition",
    "SendCtx",
    "SendRecord",
    "SendState",
    "SendTransition",
    "SenderPolicy",
    "SourceState",
    "recv_transition",
    "send_transition",
]
