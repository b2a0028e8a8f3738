"""A streamed soak request (``stream: true``) as its client reads it.

Owns: ``post_stream`` (send one completion with ``stream: true`` and read its SSE events to
the end, bounded in all, not only per read: a trickle of tokens that never ends is a hung
request too) and ``StreamRead`` (what the events added up to: the completion they make, as
a non-streamed answer would be, an error event's message, whether ``[DONE]`` ended it).
``bench.soak_report.judge_stream`` gives its outcome.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

DONE = "[DONE]"


@dataclass
class StreamRead:
    response: httpx.Response  # read to its end; its body only when the status is not 200
    done: bool = False  # "data: [DONE]" came
    error: str | None = None  # an error event's message
    garbled: int = 0  # events that are not JSON
    text: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None

    def add(self, event: dict[str, Any]) -> None:
        if "error" in event:
            err = event["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            self.error = self.error or str(msg or err)
            return
        if event.get("usage"):
            self.usage = event["usage"]
        for c in event.get("choices") or ():
            self.text.append(c.get("text") or "")
            lp = c.get("logprobs") or {}
            self.tokens += lp.get("tokens") or []
            self.token_logprobs += lp.get("token_logprobs") or []
            self.top_logprobs += lp.get("top_logprobs") or []
            self.finish_reason = c.get("finish_reason") or self.finish_reason

    def completion(self) -> dict[str, Any]:
        """The events as one non-streamed completion (``tests/e2e/greedy.py`` compares it);
        without a usage event, the tokens the stream carried."""
        usage = self.usage or {"completion_tokens": len(self.tokens)}
        logprobs = {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
        }
        choice = {"text": "".join(self.text), "logprobs": logprobs}
        return {"choices": [{**choice, "finish_reason": self.finish_reason}], "usage": usage}


def post_stream(
    client: httpx.Client,
    body: dict[str, Any],
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> StreamRead:
    """POST ``body`` to /v1/completions with ``stream: true`` (and its usage event) and read
    the answer to its end. Raises ``httpx.TimeoutException`` once ``timeout_s`` has passed
    since the request was sent, whether or not events still come."""
    deadline = clock() + timeout_s
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body, timeout=timeout_s) as resp:
        read = StreamRead(resp)
        if resp.status_code != 200:
            resp.read()
            return read
        for line in resp.iter_lines():
            if clock() > deadline:
                raise httpx.ReadTimeout(f"stream still open {timeout_s} s after it was sent")
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == DONE:
                read.done = True
                continue
            try:
                read.add(json.loads(data))
            except ValueError:
                read.garbled += 1
    return read
