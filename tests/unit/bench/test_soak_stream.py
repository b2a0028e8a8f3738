"""The soak's streamed requests (bench/soak_stream.py, bench.soak_report.judge_stream): a
whole stream adds up to the single instance's answer; an error event is a clear error; a
stream cut short, or one that ends with [DONE] but is not whole, is a broken promise; a
trickle that outlasts the request's time is a hung request. Served by httpx's MockTransport.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.soak_report import Options, Report, judge_stream
from bench.soak_stream import post_stream
from tests.e2e.greedy import MAX_TOKENS

TOKENS = [f"t{i}" for i in range(MAX_TOKENS)]


def _ref() -> dict[str, Any]:
    lps = [-0.5] * MAX_TOKENS
    tops = [{t: -0.5, "other": -3.0} for t in TOKENS]
    logprobs = {"tokens": TOKENS, "token_logprobs": lps, "top_logprobs": tops}
    return {
        "choices": [{"text": "".join(TOKENS), "logprobs": logprobs, "finish_reason": "length"}],
        "usage": {"completion_tokens": MAX_TOKENS},
    }


def _event(i: int, last: bool) -> dict[str, Any]:
    t = TOKENS[i]
    lp = {"tokens": [t], "token_logprobs": [-0.5], "top_logprobs": [{t: -0.5, "other": -3.0}]}
    choice = {"text": t, "logprobs": lp, "finish_reason": "length" if last else None}
    return {"choices": [choice]}


def _sse(events: list[Any], done: bool = True) -> bytes:
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(lines + (["data: [DONE]\n\n"] if done else [])).encode()


def _whole(n: int = MAX_TOKENS) -> list[Any]:
    usage = {"choices": [], "usage": {"completion_tokens": n}}
    return [_event(i, i == n - 1) for i in range(n)] + [usage]


def _judge(status: int, body: bytes) -> tuple[str, Report]:
    def answer(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
        ctype = "text/event-stream" if status == 200 else "application/json"
        return httpx.Response(status, content=body, headers={"content-type": ctype})

    report = Report(Options())
    with httpx.Client(base_url="http://d", transport=httpx.MockTransport(answer)) as c:
        read = post_stream(c, {"prompt": [1, 2]}, 10.0)
    return judge_stream(read, _ref(), "request 0", report, threading.Lock()), report


def test_a_whole_stream_adds_up_to_the_single_instance_answer() -> None:
    outcome, report = _judge(200, _sse(_whole()))
    assert outcome == "ok", report.mismatches


@pytest.mark.parametrize(
    "events",
    [
        [_event(i, False) for i in range(MAX_TOKENS)],  # no finish_reason: cut before the end
        _whole(MAX_TOKENS - 1),  # ends in order, one token short
        [*_whole()[:3], _event(9, False), *_whole()[4:]],  # a token not the reference's
    ],
    ids=["no-finish", "short", "wrong-token"],
)
def test_a_stream_that_ends_with_done_but_is_not_whole_is_a_mismatch(events: list[Any]) -> None:
    outcome, report = _judge(200, _sse(events))
    assert outcome == "mismatch" and report.mismatches


def test_an_error_event_is_a_clear_error() -> None:
    err = {"error": {"message": "prefill failed: peer_lost", "type": "bad_gateway"}}
    outcome, report = _judge(200, _sse([*_whole()[:5], err]))
    assert outcome == "error"
    assert list(report.errors) == ["stream: prefill failed: peer_lost"]


@pytest.mark.parametrize(
    "body", [_sse(_whole(), done=False), _sse([*_whole(), "{not json"])], ids=["cut", "garbled"]
)
def test_a_stream_cut_short_or_garbled_is_not_a_clear_error(body: bytes) -> None:
    outcome, report = _judge(200, body)
    assert outcome == "unclear_error" and report.errors


def test_a_failure_before_the_stream_is_judged_as_an_answer() -> None:
    body = json.dumps({"error": {"message": "no decode instance", "code": 503}}).encode()
    assert _judge(503, body)[0] == "error"
    assert _judge(500, body)[0] == "unclear_error"  # a 500 is never a clear error
    assert _judge(502, b"<html>bad gateway</html>")[0] == "unclear_error"


def test_a_stream_still_trickling_past_its_time_is_hung() -> None:
    seconds = iter(range(1000))  # each look at the clock: a second later

    def trickle() -> Iterator[bytes]:
        for e in _whole():  # events keep coming: no read ever times out
            yield _sse([e], done=False)

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=trickle())

    with (
        httpx.Client(base_url="http://d", transport=httpx.MockTransport(answer)) as c,
        pytest.raises(httpx.TimeoutException),
    ):
        post_stream(c, {"prompt": [1]}, 5.0, clock=lambda: float(next(seconds)))
