"""The client's answer as raw ASGI messages: its start, its body, an error answer, and the
end of an SSE stream.

Owns: ``SSE_DONE``, ``start``, ``send_body``, ``send_error``, ``event_break``, and
``error_response`` (an error answer as a Starlette response; ``send_json_error``, the same
as ASGI messages).

Must not import: ``connector.router.app`` or the relay modules.
"""

from __future__ import annotations

import json
from typing import Any, Final

from starlette.responses import JSONResponse
from starlette.types import Send

from connector.router.upstream import UpstreamError

SSE_DONE: Final = b"data: [DONE]\n\n"  # the last event of an OpenAI stream


def start(status: int, content_type: str, request_id: str) -> dict[str, Any]:
    return {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", content_type.encode()),
            (b"x-request-id", request_id.encode()),
        ],
    }


async def send_body(send: Send, body: bytes) -> None:
    """The answer's last (or only) body message."""
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, err: UpstreamError, request_id: str) -> None:
    body, ctype = err.http_body()
    await send(start(err.status, ctype, request_id))
    await send_body(send, body)


def event_break(tail: bytes) -> bytes:
    """Make sure an error event does not glue onto a half-sent SSE event."""
    return b"" if tail.endswith(b"\n\n") else b"\n\n"


def _error_json(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(_error_json(status, message, kind), status_code=status)


async def send_json_error(
    send: Send, status: int, message: str, kind: str, request_id: str
) -> None:
    """The router's own error answer (``error_response``'s body) as raw ASGI messages."""
    await send(start(status, "application/json", request_id))
    await send_body(send, json.dumps(_error_json(status, message, kind)).encode())
