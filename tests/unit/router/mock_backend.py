"""A fake vLLM server (P or D) with failure knobs, for the router tests.

Knobs (set before or during a test): ``healthy``; ``health_gate`` (answer /health only once
this event is set); ``gate`` (answer a generation request only
once this event is set); ``fail_first_n`` / ``error_status`` / ``error_body`` (checked after
the gate); ``stream_gate`` (a streamed answer pauses after its first chunk until set);
``waiting`` / ``running`` / ``kv_usage`` / ``metrics_status`` (its /metrics);
``crash_mid_stream`` (drop the connection after the first chunk); ``stream_error_first_n``
(the first n streamed answers are 200 with an error event, as vLLM streams a request that
failed before its first token); ``abort_first_n`` (the first n answers are vLLM's for a
request it aborted before any token: 200, empty text, finish_reason "abort"); ``coords`` (P's probe
answer); ``pull_params`` (P's returned ``kv_transfer_params``); ``finish_reason`` of a
whole answer (``return_token_ids`` adds ``PROMPT_IDS`` and ``[TOKEN_ID]``, and usage).
``/v1/responses``: a whole answer's id is ``resp_<name>_<n>``, kept in ``stored`` unless
``store`` is false; a ``previous_response_id`` not in ``stored`` is vLLM's 404.
Records: every generation request (``requests``, ``probes``) with its body, headers and a
``disconnected`` event, set when the router closed the request before the answer was done.
Synchronisation is by events only: ``arrived``, ``first_chunk_sent``, ``wait_for(n)``,
``wait_health(n)``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.unit.router.serving import within

PROMPT_IDS = [11, 12, 13]
TOKEN_ID = 7
CHUNKS = [
    b'data: {"choices": [{"text": "hel"}]}\n\n',
    b'data: {"choices": [{"text": "lo"}]}\n\n',
    b"data: [DONE]\n\n",
]


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)


class MockBackend:
    def __init__(
        self,
        name: str,
        *,
        model: str | None = None,
        coords: dict[str, Any] | None = None,
        pull_params: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.model = model or f"{name}-model"
        self.coords = coords
        self.pull_params = pull_params
        self.healthy = True
        self.health_gate: asyncio.Event | None = None
        self.gate: asyncio.Event | None = None
        self.fail_first_n = 0
        self.error_status = 500
        self.error_body: dict[str, Any] = {
            "error": {"message": f"{name} failed", "type": "InternalServerError"}
        }
        self.stream_gate: asyncio.Event | None = None
        self.crash_mid_stream = False
        self.stream_error_first_n = 0
        self.abort_first_n = 0
        self.chunks = list(CHUNKS)
        self.finish_reason = "length"
        self.token_ids = True  # honour return_token_ids
        self.requests: list[Seen] = []
        self.probes: list[Seen] = []
        self.others: list[Seen] = []  # requests to vLLM's non-generation endpoints
        self.stored: set[str] = set()  # /v1/responses/{id} this backend knows
        self.responses: list[bytes] = []  # non-streamed bodies sent, byte for byte
        self.health_checks = 0
        # /metrics: vLLM's queue and KV gauges (the engine-load and prefix policies read them)
        self.waiting, self.running, self.kv_usage = 0, 0, 0.0
        self.metrics_status = 200
        self.arrived = asyncio.Event()  # first generation request (not a probe) is in
        self.first_chunk_sent = asyncio.Event()
        self._count = asyncio.Condition()
        self._gates: list[asyncio.Event] = []

    def release(self) -> None:
        """Open every gate this mock ever waited on (teardown: let handlers finish)."""
        for g in self._gates + [self.gate, self.stream_gate, self.health_gate]:
            if g is not None:
                g.set()

    async def wait_for(self, n: int, what: str = "") -> None:
        async def _wait() -> None:
            async with self._count:
                await self._count.wait_for(lambda: len(self.requests) >= n)

        await within(_wait(), what or f"{n} request(s) at {self.name} (got {len(self.requests)})")

    async def wait_health(self, n: int, what: str = "") -> None:
        async def _wait() -> None:
            async with self._count:
                await self._count.wait_for(lambda: self.health_checks >= n)

        await within(_wait(), what or f"{n} health check(s) at {self.name}")

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/v1/completions", self._generate, methods=["POST"]),
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
                Route("/v1/responses", self._generate, methods=["POST"]),
                Route("/version", self._other, methods=["GET"]),
                Route("/tokenize", self._other, methods=["POST"]),
                Route("/v1/responses/{rid}", self._other, methods=["GET"]),
                Route("/v1/responses/{rid}/cancel", self._other, methods=["POST"]),
            ]
        )

    async def _health(self, _request: Request) -> Response:
        async with self._count:
            self.health_checks += 1
            self._count.notify_all()
        if self.health_gate is not None:
            self._gates.append(self.health_gate)
            await self.health_gate.wait()
        return Response(status_code=200 if self.healthy else 503)

    async def _metrics(self, _request: Request) -> Response:
        labels = f'{{engine="0",model_name="{self.model}"}}'
        text = (
            f"# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{labels} {self.waiting}\n"
            f'vllm:num_requests_waiting_by_reason{{engine="0",reason="capacity"}} 99.0\n'
            f"vllm:num_requests_running{labels} {self.running}\n"
            f"vllm:kv_cache_usage_perc{labels} {self.kv_usage}\n"
        )
        return Response(text, status_code=self.metrics_status, media_type="text/plain")

    async def _models(self, _request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _other(self, request: Request) -> Response:
        """vLLM's other endpoints: what arrived, echoed; a stored response only if this
        backend holds it (``stored``), else vLLM's 404."""
        raw = await request.body()
        seen = Seen(request.url.path, json.loads(raw) if raw else {}, dict(request.headers))
        self.others.append(seen)
        rid = request.path_params.get("rid")
        if rid is not None and rid not in self.stored:
            return JSONResponse({"error": {"message": f"{rid} not found"}}, status_code=404)
        echo = {"backend": self.name, "path": seen.path, "query": request.url.query}
        return JSONResponse({**echo, "body": seen.body})

    async def _until_disconnect(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def _wait(self, request: Request, gate: asyncio.Event, seen: Seen) -> bool:
        """Wait for ``gate``; False (and ``seen.disconnected`` set) if the router left first."""
        self._gates.append(gate)
        opened = asyncio.ensure_future(gate.wait())
        left = asyncio.ensure_future(self._until_disconnect(request))
        try:
            done, _ = await asyncio.wait({opened, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            opened.cancel()
            left.cancel()
        if left in done:
            seen.disconnected.set()
            return False
        return True

    async def _generate(self, request: Request) -> Response:
        body = await request.json()
        seen = Seen(request.url.path, body, dict(request.headers))
        if (body.get("kv_transfer_params") or {}).get("pushkv_probe"):
            self.probes.append(seen)
            return JSONResponse(
                {
                    "id": "probe",
                    "choices": [{"text": "x"}],
                    "kv_transfer_params": {"pushkv": self.coords},
                }
            )
        async with self._count:
            self.requests.append(seen)
            self._count.notify_all()
        self.arrived.set()
        if self.gate is not None and not await self._wait(request, self.gate, seen):
            return Response(status_code=499)  # nobody reads it
        prev = body.get("previous_response_id")
        if seen.path == "/v1/responses" and prev is not None and prev not in self.stored:
            # vLLM's answer to a previous response it does not hold, before generating
            message = f"Response with id '{prev}' not found."
            return JSONResponse({"error": {"message": message}}, status_code=404)
        if self.fail_first_n > 0:
            self.fail_first_n -= 1
            return JSONResponse(self.error_body, status_code=self.error_status)
        if body.get("stream") and self.stream_error_first_n > 0:
            self.stream_error_first_n -= 1
            err = json.dumps({**self.error_body["error"], "code": self.error_status})
            events = [f'data: {{"error": {err}}}\n\n'.encode(), b"data: [DONE]\n\n"]
            return StreamingResponse(iter(events), media_type="text/event-stream")
        if self.abort_first_n > 0:
            self.abort_first_n -= 1
            aborted = {"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}
            if body.get("stream"):
                events = [f"data: {json.dumps(aborted)}\n\n".encode(), b"data: [DONE]\n\n"]
                return StreamingResponse(iter(events), media_type="text/event-stream")
            return JSONResponse(aborted)
        if body.get("stream"):
            return StreamingResponse(self._stream(request, seen), media_type="text/event-stream")
        rid = f"cmpl-{self.name}-{len(self.requests)}"
        if seen.path == "/v1/responses":
            rid = f"resp_{self.name}_{len(self.requests)}"
            if body.get("store", True):
                self.stored.add(rid)
        answer: dict[str, Any] = {
            "id": rid,
            "object": "text_completion",
            "model": self.model,
            "choices": [
                {"index": 0, "text": f"hello from {self.name}", "finish_reason": self.finish_reason}
            ],
        }
        if body.get("return_token_ids") and self.token_ids:
            answer["choices"][0] |= {"prompt_token_ids": PROMPT_IDS, "token_ids": [TOKEN_ID]}
            answer["usage"] = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        if self.pull_params is not None:
            answer["kv_transfer_params"] = self.pull_params
        raw = json.dumps(answer).encode()
        self.responses.append(raw)
        return Response(raw, media_type="application/json")

    async def _stream(self, request: Request, seen: Seen) -> AsyncIterator[bytes]:
        try:
            for i, chunk in enumerate(self.chunks):
                yield chunk
                if i:
                    continue
                self.first_chunk_sent.set()
                if self.crash_mid_stream:
                    raise RuntimeError(f"{self.name} crashed mid-stream (test knob)")
                if self.stream_gate is not None and not await self._wait(
                    request, self.stream_gate, seen
                ):
                    return
        except asyncio.CancelledError:
            # Starlette cancels the body when it sees the client (the router) go.
            seen.disconnected.set()
            raise
