"""Which D stored each Responses API answer, so a conversation continues where it lives.

vLLM keeps a stored response (``store``, with ``VLLM_ENABLE_RESPONSES_API_STORE=1``) in the
memory of the server that made it: a request naming it in ``previous_response_id``, and its
retrieval and cancel, work on that server only (docs/routers.md, "What the router serves").

Owns: ``ResponseHomes`` (response id -> the URL of the D that answered it, the least
recently used forgotten first past ``capacity``), ``ResponseIdReader`` (the id of D's
answer: a whole answer's ``id``, a stream's ``response.created`` / ``response.completed``
event's ``response.id``), ``previous_response_id``, and ``locate`` (the D a request
continuing a response must go to, asking each D for an id the table does not know).

Must not import: starlette, uvicorn, ``connector.router.app`` / ``relay``.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Final
from urllib.parse import quote

from connector.core.errors import PushkvError
from connector.router.backends import Backend, Backends, Role
from connector.router.policy import Health
from connector.router.upstream import TransportError

# About 200 bytes an entry (an id of ~50 characters, a URL shared with the backend): 13 MiB.
HOMES: Final = 1 << 16


class ResponseHomes:
    """Response id -> URL of the D that answered it. Bounded: past ``capacity`` the least
    recently used id is forgotten; a forgotten id is found again by asking each D."""

    def __init__(self, capacity: int = HOMES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._homes: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def remember(self, response_id: str, url: str) -> None:
        self._homes[response_id] = url
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.capacity:
            self._homes.popitem(last=False)

    def home(self, response_id: str) -> str | None:
        url = self._homes.get(response_id)
        if url is not None:
            self._homes.move_to_end(response_id)
        return url

    def stats(self) -> dict[str, int]:
        return {"known": len(self._homes), "capacity": self.capacity}


def previous_response_id(body: Mapping[str, Any]) -> str | None:
    prev = body.get("previous_response_id")
    return prev if isinstance(prev, str) and prev else None


class ResponseIdReader:
    """Calls ``on_id`` once with the id of D's answer, read from what the client is sent."""

    def __init__(self, on_id: Callable[[str], None]) -> None:
        self._on_id = on_id
        self.response_id: str | None = None

    def whole(self, body: bytes) -> None:
        try:
            answer = json.loads(body)
        except ValueError:
            return
        if isinstance(answer, dict):
            self._found(answer.get("id"))

    def events(self, events: bytes) -> None:
        """Whole SSE events. vLLM names the response in its first event (``response.created``)
        and again in its last; only those carry a ``"response":`` object."""
        if self.response_id is not None or b'"response":' not in events:
            return
        for line in events.split(b"\n"):
            if line.startswith(b"data: {") and b'"response":' in line:
                try:
                    event = json.loads(line[6:])
                except ValueError:
                    continue
                response = event.get("response") if isinstance(event, dict) else None
                if isinstance(response, dict):
                    self._found(response.get("id"))
                    if self.response_id is not None:
                        return

    def _found(self, response_id: Any) -> None:
        if isinstance(response_id, str) and response_id and self.response_id is None:
            self.response_id = response_id
            self._on_id(response_id)


class HomeUnavailable(PushkvError):
    """The D holding a previous response cannot take the request; ``status`` and the
    message are the client's answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


async def _holds(d: Backend, response_id: str, headers: dict[str, str] | None) -> bool:
    path = f"/v1/responses/{quote(response_id, safe='')}"  # the client's string, not a path
    try:
        r = await d.http.request("GET", path, headers=headers)
    except TransportError:
        return False
    return r.status_code == 200


async def locate(
    backends: Backends, homes: ResponseHomes, response_id: str, authorization: str | None
) -> Backend | None:
    """The D that must serve a request continuing ``response_id``: the one that answered
    it, or, for an id this router does not know (made before it started, through another
    replica, or forgotten), the D that answers its retrieval. None when no D has it: any D
    answers vLLM's own 404. ``HomeUnavailable`` when its D is down, draining or removed:
    another D would answer a misleading 404 (the response exists, elsewhere)."""
    url = homes.home(response_id)
    if url is None:
        headers = {"Authorization": authorization} if authorization else None
        ds = [d for d in backends.pool(Role.DECODE) if d.load.health is not Health.DOWN]
        held = await asyncio.gather(*(_holds(d, response_id, headers) for d in ds))
        found = next((d for d, h in zip(ds, held, strict=True) if h), None)
        if found is None:
            return None
        url = found.url
        homes.remember(response_id, url)
    d = backends.find(Role.DECODE, url)
    stored = f"previous_response_id {response_id!r} is stored only on decode server {url}"
    why = "vLLM keeps a stored response in the memory of the server that made it"
    if d is None:
        raise HomeUnavailable(404, f"{stored}, which was removed from this router ({why})")
    if d.load.draining or not (d.load.eligible or d.load.fallback):
        state = "draining" if d.load.draining else d.load.health.value
        raise HomeUnavailable(
            503,
            f"{stored}, which is {state}: retry once it is back, or start a new "
            f"conversation without previous_response_id ({why})",
        )
    return d
