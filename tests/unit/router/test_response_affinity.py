"""``/v1/responses`` conversations stay on the D that stores them (issue #32): a request
with ``previous_response_id`` goes to the D that answered that response (learnt from a
whole answer's ``id`` or a stream's ``response.created`` event, else by asking each D), or
gets a clear error when that D cannot take it; a retrieval or cancel of a known id goes to
its D alone. The table is bounded."""

from __future__ import annotations

import json

import pytest

from connector.router.response_homes import ResponseHomes, ResponseIdReader
from telemetry.schema import Attr, Span
from tests.unit.router.conftest import MakeCluster
from tests.unit.router.mock_backend import MockBackend
from tests.unit.telemetry.memory import Recorder

pytestmark = pytest.mark.anyio

TURN = {"model": "m", "input": "hello", "max_output_tokens": 8}


def events(response_id: str) -> list[bytes]:
    """vLLM's Responses stream, naming ``response_id`` in its first and last events."""
    created = {"type": "response.created", "response": {"id": response_id, "status": "queued"}}
    delta = {"type": "response.output_text.delta", "delta": "hi"}
    done = {"type": "response.completed", "response": {"id": response_id, "output": []}}
    return [
        f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in (created, delta, done)
    ]


def served_by(*ds: MockBackend) -> list[int]:
    return [len(d.requests) for d in ds]


async def test_a_follow_up_goes_to_the_d_that_answered_with_the_reason_traced(
    cluster: MakeCluster,
) -> None:
    rec = Recorder()
    # least-load sends the second request to the other D, unless it continues the first
    c = await cluster(1, 2, tracer=rec.tracer)
    first = await c.client.post("/v1/responses", json=TURN)
    assert first.status_code == 200, first.text
    assert served_by(*c.d) == [1, 0]
    rid = first.json()["id"]
    second = await c.client.post("/v1/responses", json={**TURN, "previous_response_id": rid})
    assert second.status_code == 200, second.text
    assert served_by(*c.d) == [2, 0]
    third = await c.client.post("/v1/responses", json=TURN)  # a new conversation: by policy
    assert third.status_code == 200 and served_by(*c.d) == [2, 1]
    reasons = [s.attributes[Attr.ROUTE_REASON.value] for s in rec.named(Span.REQUEST)]
    assert [f"previous_response_id {rid!r} is stored on this D only" in r for r in reasons] == [
        False,
        True,
        False,
    ]
    stats = (await c.client.get("/router/stats")).json()
    assert stats["stored_responses"]["known"] == 3


async def test_a_streamed_answer_is_remembered_by_its_created_event(cluster: MakeCluster) -> None:
    def setup(_ps: list[MockBackend], ds: list[MockBackend]) -> None:
        for i, d in enumerate(ds):
            d.chunks = events(f"resp_stream_{i}")
            d.stored.add(f"resp_stream_{i}")

    c = await cluster(1, 2, setup=setup)
    first = await c.client.post("/v1/responses", json={**TURN, "stream": True})
    assert first.status_code == 200 and first.content == b"".join(events("resp_stream_0"))
    follow = {**TURN, "previous_response_id": "resp_stream_0"}
    assert (await c.client.post("/v1/responses", json=follow)).status_code == 200
    assert served_by(*c.d) == [2, 0]
    assert c.d[1].others == []  # known: nobody was asked


async def test_an_id_the_router_never_saw_is_found_by_asking_each_d(cluster: MakeCluster) -> None:
    def setup(_ps: list[MockBackend], ds: list[MockBackend]) -> None:
        ds[1].stored.add("resp_before")  # answered before this router started

    c = await cluster(1, 2, setup=setup)
    follow = {**TURN, "previous_response_id": "resp_before"}
    for _ in range(2):
        r = await c.client.post("/v1/responses", json=follow)
        assert r.status_code == 200, r.text
    assert served_by(*c.d) == [0, 2]
    # asked once each; the second request found it in the table
    assert [s.path for s in c.d[0].others] == ["/v1/responses/resp_before"]
    assert [s.path for s in c.d[1].others] == ["/v1/responses/resp_before"]


async def test_an_id_no_d_holds_gets_vllms_own_404(cluster: MakeCluster) -> None:
    c = await cluster(1, 2)
    r = await c.client.post("/v1/responses", json={**TURN, "previous_response_id": "resp_x"})
    assert r.status_code == 404 and "resp_x" in r.json()["error"]["message"], r.text
    assert sum(served_by(*c.d)) == 1  # one D answered, as vLLM alone would


async def test_the_id_asked_of_each_d_stays_one_path_segment(cluster: MakeCluster) -> None:
    c = await cluster(1, 2)
    prev = "x/../../../version"  # a client's string must not reach another endpoint
    r = await c.client.post("/v1/responses", json={**TURN, "previous_response_id": prev})
    assert r.status_code == 404, r.text
    assert [s.path for d in c.d for s in d.others if s.path == "/version"] == []


@pytest.mark.parametrize("how", ["down", "draining", "removed"])
async def test_a_home_that_cannot_serve_is_a_clear_error_not_another_d(
    cluster: MakeCluster, how: str
) -> None:
    c = await cluster(1, 2)
    rid = (await c.client.post("/v1/responses", json=TURN)).json()["id"]
    home = c.state.backends.decode[0]
    if how == "down":
        c.d[0].healthy = False
        await c.check_health()
    elif how == "draining":
        c.state.backends.set_draining(home, True)
    else:
        await c.state.backends.remove(home)
    r = await c.client.post("/v1/responses", json={**TURN, "previous_response_id": rid})
    assert r.status_code == (404 if how == "removed" else 503), r.text
    message = r.json()["error"]["message"]
    assert rid in message and home.url in message and how in message, message
    assert served_by(*c.d) == [1, 0]  # the other D, which would answer a wrong 404, got nothing


async def test_a_failure_of_the_home_is_not_retried_on_another_d(cluster: MakeCluster) -> None:
    c = await cluster(1, 2, max_attempts=2)
    rid = (await c.client.post("/v1/responses", json=TURN)).json()["id"]
    c.d[0].fail_first_n = 1
    r = await c.client.post("/v1/responses", json={**TURN, "previous_response_id": rid})
    assert r.status_code == 500 and "d0 failed" in r.text
    assert served_by(*c.d) == [2, 0]
    assert c.state.retries["decode"] == 0


async def test_retrieval_and_cancel_of_a_known_id_go_to_its_d_alone(cluster: MakeCluster) -> None:
    c = await cluster(1, 2)
    await c.client.post("/v1/responses", json=TURN)  # d0: a conversation of its own
    rid = (await c.client.post("/v1/responses", json=TURN)).json()["id"]  # on d1
    got = await c.client.get(f"/v1/responses/{rid}")
    assert got.status_code == 200 and got.json()["backend"] == "d1"
    cancel = await c.client.post(f"/v1/responses/{rid}/cancel")
    assert cancel.status_code == 200 and cancel.json()["backend"] == "d1"
    assert c.d[0].others == [] and len(c.d[1].others) == 2


def test_the_table_is_bounded_least_recently_used_forgotten_first() -> None:
    homes = ResponseHomes(capacity=2)
    homes.remember("a", "http://d0")
    homes.remember("b", "http://d1")
    assert homes.home("a") == "http://d0"  # a is now the most recently used
    homes.remember("c", "http://d1")
    assert (homes.home("a"), homes.home("b"), homes.home("c")) == ("http://d0", None, "http://d1")
    assert homes.stats() == {"known": 2, "capacity": 2}
    with pytest.raises(ValueError):
        ResponseHomes(capacity=0)


def test_the_reader_takes_the_first_id_of_a_whole_answer_or_a_stream() -> None:
    seen: list[str] = []
    whole = ResponseIdReader(seen.append)
    whole.whole(b'{"id": "resp_1", "object": "response"}')
    whole.whole(b'{"id": "resp_2"}')  # once per answer
    streamed = ResponseIdReader(seen.append)
    streamed.events(b'event: response.output_text.delta\ndata: {"delta": "x"}\n\n')
    for event in events("resp_3"):
        streamed.events(event)
    errored = ResponseIdReader(seen.append)
    errored.whole(b'{"error": {"message": "bad"}}')
    errored.events(b"data: not json\n\n")
    assert seen == ["resp_1", "resp_3"]
