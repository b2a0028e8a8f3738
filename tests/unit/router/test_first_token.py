"""First token from P (``--first-token prefill``): which requests it serves, what each leg
gets, what the client's stream is, and its failure rules (connector/router/first_token.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from connector.core.errors import ConfigError, RemoteProtocolError
from connector.router import first_token as ft
from connector.router.config import FirstToken, Mode, RouterConfig, parse_args
from connector.router.legs import Endpoint
from tests.unit.router.conftest import MakeCluster
from tests.unit.router.mock_backend import CHUNKS, PROMPT_IDS, TOKEN_ID
from tests.unit.router.serving import within
from tests.unit.router.test_streaming import sse_events

STREAM: dict[str, Any] = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True}
# What `vllm bench serve --backend vllm` sends (vllm/benchmarks/lib/endpoint_request_func.py).
BENCH = {
    **STREAM,
    "repetition_penalty": 1.0,
    "logprobs": None,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
}


# -- which requests ---------------------------------------------------------------------


@pytest.mark.parametrize("body", [STREAM, BENCH, {**STREAM, "temperature": 0, "seed": 3}])
def test_position_independent_streams_are_served_from_p(body: dict[str, Any]) -> None:
    assert ft.blocker(Endpoint.COMPLETIONS, body) is None


@pytest.mark.parametrize(
    ("endpoint", "extra", "why"),
    [
        (Endpoint.CHAT, {}, "chat"),
        (Endpoint.COMPLETIONS, {"stream": False}, "not streamed"),
        (Endpoint.COMPLETIONS, {"max_tokens": 1}, "max_tokens"),
        (Endpoint.COMPLETIONS, {"stop": ["\n"]}, "stop strings"),
        (Endpoint.COMPLETIONS, {"presence_penalty": 0.5}, "presence_penalty"),
        (Endpoint.COMPLETIONS, {"repetition_penalty": 1.2}, "repetition_penalty"),
        (Endpoint.COMPLETIONS, {"seed": 3, "temperature": 0.8}, "seeded"),
        (Endpoint.COMPLETIONS, {"echo": True}, "echo"),
        (Endpoint.COMPLETIONS, {"return_token_ids": True}, "return_token_ids"),
        (Endpoint.COMPLETIONS, {"stream_options": {"continuous_usage_stats": True}}, "continuous"),
        (Endpoint.COMPLETIONS, {"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ],
)
def test_other_requests_say_why_not(endpoint: Endpoint, extra: dict[str, Any], why: str) -> None:
    reason = ft.blocker(endpoint, {**STREAM, **extra})
    assert reason is not None and why in reason


def test_neutral_values_do_not_block() -> None:
    neutral = {"stop": [], "presence_penalty": 0, "echo": False, "suffix": None, "seed": None}
    assert ft.blocker(Endpoint.COMPLETIONS, {**STREAM, **neutral}) is None


# -- P's answer and D's leg ----------------------------------------------------------------


def p_answer(finish: str = "length", **choice: Any) -> dict[str, Any]:
    c = {"index": 0, "text": " a", "finish_reason": finish, "logprobs": None}
    c |= {"prompt_token_ids": [1, 2], "token_ids": [9]} | choice
    return {"id": "cmpl-r1", "created": 5, "model": "m", "choices": [c], "usage": {"x": 1}}


def test_prefill_token_is_read_strictly() -> None:
    t = ft.PrefillToken.read(p_answer())
    assert (t.prompt_ids, t.token_id, t.stopped) == ([1, 2], 9, False)
    assert ft.PrefillToken.read(p_answer("stop")).stopped
    for bad in (
        {"token_ids": [9, 10]},
        {"token_ids": []},
        {"prompt_token_ids": []},
        {"prompt_token_ids": ["a"]},
        {"token_ids": None},
    ):
        with pytest.raises(RemoteProtocolError):
            ft.PrefillToken.read(p_answer(**bad))
    with pytest.raises(RemoteProtocolError):
        ft.PrefillToken.read({"choices": []})


def test_continuation_continues_from_ps_token() -> None:
    body = {**STREAM, "min_tokens": 3, "add_special_tokens": True}
    out = ft.continuation_body(body, ft.PrefillToken.read(p_answer()))
    assert out["prompt"] == [1, 2, 9]
    assert (out["max_tokens"], out["min_tokens"]) == (7, 2)
    assert "add_special_tokens" not in out
    assert body["prompt"] == "hello"  # the router's copy of the client's body is untouched


def test_first_event_is_a_vllm_stream_chunk() -> None:
    event = ft.first_event(ft.PrefillToken.read(p_answer()))
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    obj = json.loads(event[6:])
    assert (obj["id"], obj["object"], obj["model"]) == ("cmpl-r1", "text_completion", "m")
    assert obj["choices"] == [
        {"index": 0, "text": " a", "logprobs": None, "finish_reason": None, "stop_reason": None}
    ]


def test_a_stopping_token_ends_the_stream_with_ps_usage() -> None:
    token = ft.PrefillToken.read(p_answer("stop", stop_reason=2))
    assert json.loads(ft.first_event(token)[6:])["choices"][0]["finish_reason"] == "stop"
    events = ft.final_events(token, {"stream_options": {"include_usage": True}})
    usage, done = events.split(b"\n\n")[:2]
    assert json.loads(usage[6:])["usage"] == {"x": 1} and done == b"data: [DONE]"
    assert ft.final_events(token, {}) == b"data: [DONE]\n\n"


def test_usage_counts_ps_token_as_output() -> None:
    usage = (
        b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":7,"total_tokens":11}}'
    )
    other = b'data: {"choices":[{"text":"x"}]}'
    out = ft.count_token_as_output(other + b"\n\n" + usage + b"\n\n")
    first, second = out.split(b"\n\n")[:2]
    assert first == other
    assert json.loads(second[6:])["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 8,
        "total_tokens": 11,
    }
    broken = b'data: {"usage":{"prompt_tokens":"?"}}\n\n'
    assert ft.count_token_as_output(broken) == broken


def test_config_needs_push_mode() -> None:
    with pytest.raises(ConfigError, match="--mode push"):
        RouterConfig(
            ("http://p:1",), ("http://d:2",), mode=Mode.PULL, first_token=FirstToken.PREFILL
        )
    cfg = parse_args(["--prefill", "http://p:1", "--decode", "http://d:2", "--port", "3"])
    assert cfg.first_token is FirstToken.DECODE
    cfg = parse_args(
        [
            "--prefill",
            "http://p:1",
            "--decode",
            "http://d:2",
            "--port",
            "3",
            "--first-token",
            "prefill",
        ]
    )
    assert cfg.first_token is FirstToken.PREFILL


# -- through the router ----------------------------------------------------------------------

pytestmark_anyio = pytest.mark.anyio  # only the router tests: the rest are plain


@pytestmark_anyio
async def test_client_gets_ps_token_before_d_is_asked(cluster: MakeCluster) -> None:
    c = await cluster(first_token=FirstToken.PREFILL)
    p, d = c.p[0], c.d[0]
    d.gate = asyncio.Event()  # D answers only when the test says so
    async with c.client.stream("POST", "/v1/completions", json=BENCH) as r:
        assert r.status_code == 200
        chunks = r.aiter_raw()
        first = await within(anext(chunks), "P's token while D has not answered")
        assert json.loads(first[6:])["choices"][0]["text"] == "hello from p0"
        await d.wait_for(1, "D's leg after P's answer")
        d.gate.set()
        rest = b"".join([chunk async for chunk in chunks])
    p_body, d_body = p.requests[0].body, d.requests[0].body
    assert p_body["return_token_ids"] is True and p_body["max_tokens"] == 1
    assert d_body["prompt"] == [*PROMPT_IDS, TOKEN_ID] and d_body["max_tokens"] == 7
    assert (
        d_body["kv_transfer_params"]["transfer_id"] == p_body["kv_transfer_params"]["transfer_id"]
    )
    assert rest == b"".join(CHUNKS)


@pytestmark_anyio
async def test_blocked_requests_send_both_legs_at_once(cluster: MakeCluster) -> None:
    c = await cluster(first_token=FirstToken.PREFILL)
    c.p[0].gate = asyncio.Event()  # P never answers before D is asked
    r = asyncio.ensure_future(c.client.post("/v1/completions", json={**STREAM, "stop": ["x"]}))
    await c.d[0].wait_for(1, "D's leg while P is still computing")
    c.p[0].gate.set()
    assert (await within(r, "the answer")).status_code == 200
    assert "return_token_ids" not in c.p[0].requests[0].body
    assert c.d[0].requests[0].body["prompt"] == "hello"


@pytestmark_anyio
async def test_a_stopping_first_token_needs_no_d(cluster: MakeCluster) -> None:
    c = await cluster(first_token=FirstToken.PREFILL)
    c.p[0].finish_reason = "stop"
    r = await c.client.post("/v1/completions", json=BENCH)
    events = sse_events(r.content)
    first, usage = json.loads(events[0]), json.loads(events[1])
    assert first["choices"][0]["finish_reason"] == "stop" and "pushkv_trace_id" in first
    assert usage["usage"]["completion_tokens"] == 1 and events[2] == "[DONE]"
    assert c.d[0].requests == []


@pytestmark_anyio
async def test_d_failing_after_ps_token_ends_the_stream_with_an_error(cluster: MakeCluster) -> None:
    c = await cluster(first_token=FirstToken.PREFILL)
    c.d[0].fail_first_n, c.d[0].error_status = 1, 503
    r = await c.client.post("/v1/completions", json=STREAM)
    assert r.status_code == 200  # the stream had started with P's token
    events = sse_events(r.content)
    assert json.loads(events[0])["choices"][0]["text"] == "hello from p0"
    assert json.loads(events[1])["error"]["code"] == 503 and events[2] == "[DONE]"


@pytestmark_anyio
async def test_p_without_token_ids_is_a_502_before_any_byte(cluster: MakeCluster) -> None:
    c = await cluster(first_token=FirstToken.PREFILL, max_attempts=1)
    c.p[0].token_ids = False  # an older vLLM: no return_token_ids
    r = await c.client.post("/v1/completions", json=STREAM)
    assert r.status_code == 502 and "prompt_token_ids" in r.json()["error"]["message"]
    assert c.d[0].requests == []
