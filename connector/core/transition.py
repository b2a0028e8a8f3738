"""What P's and D's transition tables share: the deadline event and the out-of-turn rule.

A (state, event) pair missing from a table is an error: a message from the peer out of turn
raises RemoteProtocolError (the caller drops and counts it), one of our own events out of
turn raises LocalProtocolError (our bug).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NoReturn

from connector.core import events as ev
from connector.core.errors import LocalProtocolError, RemoteProtocolError


@dataclass(frozen=True)
class DeadlinePassed:
    """Synthesised by the tables' ``tick``: the record's current deadline is due."""

    transfer_id: str


LOCAL_EVENTS = (
    ev.PrefillDone,
    ev.PrefillAborted,
    ev.SourceReclaimed,
    ev.WriteDone,
    ev.WriteFailed,
    ev.Expected,
    ev.AbortRequested,
    ev.ShutdownDue,
)


def raise_out_of_turn(event: object, state: enum.Enum | None) -> NoReturn:
    where = state.name if state is not None else "an unknown transfer"
    msg = f"{type(event).__name__} in {where}"
    if isinstance(event, LOCAL_EVENTS):
        raise LocalProtocolError(msg)
    raise RemoteProtocolError(msg)
