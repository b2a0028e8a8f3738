"""Where each leg of one attempt stands: one record per leg with an explicit state, moved
only by the events of a single transition table.

Owns: ``LegState``, ``LegEvent``, ``TRANSITIONS`` (every allowed (state, event) pair; any
other raises ``LocalProtocolError``: a router bug) and ``LegTrack`` (a leg's state, why it
ended, and what the attempt holds of it: P's task, D's open answer).

Pure: no I/O. Must not import: ``connector.router.relay`` and the modules it drives.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Any, Final

from connector.core.errors import LocalProtocolError
from connector.router.backends import Role
from connector.router.upstream import Stream
from telemetry.schema import Outcome


class LegState(enum.Enum):
    UNSENT = "unsent"  # not sent: not yet, or never (D after P's token ended the request)
    SENT = "sent"  # request out, no answer yet
    RELAYING = "relaying"  # D: status and headers in, its body goes to the client as it comes
    DONE = "done"  # P answered; D: the client has D's whole answer
    DETACHED = "detached"  # P still running after D's answer went out: left to its deadline
    FAILED = "failed"  # the backend failed the leg (``reason`` says how)
    CANCELLED = "cancelled"  # closed by the router: the other leg failed, or the client left


class LegEvent(enum.Enum):
    SENT = "sent"
    OPENED = "opened"  # D's status and headers arrived
    COMPLETED = "completed"
    DETACHED = "detached"
    FAILED = "failed"
    CANCELLED = "cancelled"


S, E = LegState, LegEvent
TRANSITIONS: Final[dict[tuple[LegState, LegEvent], LegState]] = {
    (S.UNSENT, E.SENT): S.SENT,
    (S.SENT, E.OPENED): S.RELAYING,
    (S.SENT, E.COMPLETED): S.DONE,
    (S.SENT, E.DETACHED): S.DETACHED,
    (S.SENT, E.FAILED): S.FAILED,
    (S.SENT, E.CANCELLED): S.CANCELLED,
    (S.RELAYING, E.COMPLETED): S.DONE,
    (S.RELAYING, E.FAILED): S.FAILED,
    (S.RELAYING, E.CANCELLED): S.CANCELLED,
    # The client has D's whole answer: a break after it changes nothing for the request.
    (S.DONE, E.COMPLETED): S.DONE,
    (S.DONE, E.FAILED): S.DONE,
    (S.DONE, E.CANCELLED): S.DONE,
    (S.DETACHED, E.COMPLETED): S.DONE,
    (S.DETACHED, E.FAILED): S.FAILED,
    (S.DETACHED, E.CANCELLED): S.CANCELLED,
}
# Nothing moves a leg out of these (a DETACHED P still ends on its own).
ENDED: Final = frozenset({S.DONE, S.FAILED, S.CANCELLED})


@dataclass
class LegTrack:
    """One leg of one attempt. ``task``: P's leg when it runs next to D's (push modes);
    ``stream``: D's answer once open (closed at the attempt's end)."""

    role: Role
    state: LegState = LegState.UNSENT
    reason: str | None = None  # why it failed or was cancelled
    task: asyncio.Task[Any] | None = None
    stream: Stream | None = None

    def on(self, event: LegEvent, reason: str | None = None) -> LegState:
        try:
            state = TRANSITIONS[(self.state, event)]
        except KeyError:
            raise LocalProtocolError(
                f"{self.role.value} leg: can't handle {event.value} in state {self.state.value}"
            ) from None
        if state is not self.state and reason is not None:
            self.reason = reason
        self.state = state
        return state

    @property
    def open(self) -> bool:
        """Sent and not ended: closing the attempt must close it."""
        return self.state in (S.SENT, S.RELAYING)

    def outcome(self) -> str | None:
        """The reason its span ends with: None when done, else why (cancelled if no other)."""
        if self.state is S.DONE:
            return None
        return self.reason or Outcome.CANCELLED.value
