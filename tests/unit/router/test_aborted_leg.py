"""A D that aborts a request before its first token (vLLM's answer to a leg that reached it
as it began shutting down: 200, no text, finish_reason "abort") has failed the leg: the
request goes to another D, whole or streamed; with no other D the client gets a 503 that
says so, not an empty 200. An answer with tokens that ends "abort" is the client's, as is."""

from __future__ import annotations

import pytest

from tests.unit.router.conftest import MakeCluster
from tests.unit.router.mock_backend import CHUNKS

pytestmark = pytest.mark.anyio

COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 8}


@pytest.mark.parametrize("stream", [False, True])
async def test_an_aborted_leg_is_served_by_the_other_d(cluster: MakeCluster, stream: bool) -> None:
    c = await cluster(1, 2)
    c.d[0].abort_first_n = 1  # the first D chosen (least load, ties by index)
    r = await c.client.post("/v1/completions", json={**COMPLETION, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        assert CHUNKS[0] in r.content and b"abort" not in r.content
    else:
        assert r.json()["choices"][0]["text"] == "hello from d1"
    assert [len(d.requests) for d in c.d] == [1, 1], "one leg to each D, D0 first"
    s = (await c.client.get("/router/stats")).json()
    assert s["requests"]["retried"] == {"total": 1, "decode": 1}


async def test_with_no_other_d_the_client_gets_a_503_naming_the_abort(
    cluster: MakeCluster,
) -> None:
    c = await cluster(1, 1)
    c.d[0].abort_first_n = 1
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 503, r.text
    assert "aborted the request before its first token" in r.json()["error"]["message"]


async def test_an_answer_with_tokens_that_ends_abort_passes_on(cluster: MakeCluster) -> None:
    c = await cluster(1, 1)
    c.d[0].finish_reason = "abort"  # text "hello from d0", then aborted
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "abort"
    assert len(c.d[0].requests) == 1
