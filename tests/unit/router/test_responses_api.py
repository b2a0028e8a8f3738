"""``/v1/responses`` through the router: to D alone, the reason on the request span, D's
stream passed on byte for byte, with the router's auth, retry and drain; vLLM's other
endpoints forwarded to a D, and a JSON 404 naming what the router serves (issue #32)."""

from __future__ import annotations

import pytest

from connector.router import legs
from telemetry.schema import Attr, Span
from tests.unit.router.conftest import MakeCluster
from tests.unit.telemetry.memory import Recorder

pytestmark = pytest.mark.anyio

RESPONSE = {"model": "m", "input": "hello", "max_output_tokens": 8, "temperature": 0}
# What vLLM streams for /v1/responses: named events, no [DONE].
EVENTS = [
    b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n',
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"delta":"hel","sequence_number":1}\n\n',
    b'event: response.completed\ndata: {"type":"response.completed","response":'
    b'{"status":"completed","output":[]},"sequence_number":2}\n\n',
]


@pytest.mark.parametrize("stream", [False, True])
async def test_goes_to_d_whole_with_the_reason_traced(cluster: MakeCluster, stream: bool) -> None:
    rec = Recorder()

    def setup(_ps: list, ds: list) -> None:  # type: ignore[type-arg]
        ds[0].chunks = list(EVENTS)

    c = await cluster(1, 1, tracer=rec.tracer, setup=setup)
    body = {**RESPONSE, "stream": stream}
    r = await c.client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert c.p[0].requests == []
    (seen,) = c.d[0].requests
    assert (seen.path, seen.body) == ("/v1/responses", body)  # no kv_transfer_params
    if stream:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.content == b"".join(EVENTS)  # passed on unchanged
    else:
        assert r.content == c.d[0].responses[0]
    root = rec.one(Span.REQUEST)
    assert root.attributes[Attr.ROUTE_REASON.value].startswith(f"D alone: {legs.RESPONSES_ALONE}")
    assert root.attributes[Attr.DEGRADED.value] is False
    assert c.state.degraded == 0
    assert c.state.responses[200] == 1  # counted like the other endpoints


async def test_a_failed_d_is_retried_on_another(cluster: MakeCluster) -> None:
    def setup(_ps: list, ds: list) -> None:  # type: ignore[type-arg]
        ds[0].fail_first_n = 1

    c = await cluster(1, 2, setup=setup, max_attempts=2)
    r = await c.client.post("/v1/responses", json=RESPONSE)
    assert r.status_code == 200, r.text
    assert (len(c.d[0].requests), len(c.d[1].requests)) == (1, 1)
    assert c.state.retries["decode"] == 1


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "m"}, 400),  # no input
        ({"model": "m", "input": 3}, 400),
        ({"model": "m", "input": [{"role": "user", "content": "hi"}]}, 200),
        ({**RESPONSE, "kv_transfer_params": {"do_remote_decode": True}}, 400),
    ],
)
async def test_the_body_is_checked_as_the_other_endpoints(
    cluster: MakeCluster, body: dict[str, object], status: int
) -> None:
    c = await cluster(1, 1)
    r = await c.client.post("/v1/responses", json=body)
    assert r.status_code == status, r.text
    assert len(c.d[0].requests) == (status == 200)


async def test_api_key_and_backend_key(cluster: MakeCluster) -> None:
    c = await cluster(1, 1, api_key="client-key", backend_api_key="backend-key")
    assert (await c.client.post("/v1/responses", json=RESPONSE)).status_code == 401
    assert (await c.client.get("/version")).status_code == 401
    auth = {"Authorization": "Bearer client-key"}
    assert (await c.client.post("/v1/responses", json=RESPONSE, headers=auth)).status_code == 200
    assert (await c.client.get("/version", headers=auth)).status_code == 200
    for seen in (c.d[0].requests[0], c.d[0].others[0]):
        assert seen.headers["authorization"] == "Bearer backend-key"


async def test_a_draining_router_refuses_new_responses(cluster: MakeCluster) -> None:
    c = await cluster(1, 1)
    c.state.drain.begin()  # what SIGTERM does first
    r = await c.client.post("/v1/responses", json=RESPONSE)
    assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
    assert c.d[0].requests == []


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/version", None),
        ("POST", "/tokenize", {"model": "m", "prompt": "hi"}),
        ("GET", "/v1/models", None),
    ],
)
async def test_other_vllm_endpoints_go_to_a_d(
    cluster: MakeCluster, method: str, path: str, body: dict[str, object] | None
) -> None:
    c = await cluster(1, 1)
    r = await c.client.request(method, path, json=body)
    assert r.status_code == 200, r.text
    assert c.p[0].requests == c.p[0].others == []
    if path != "/v1/models":
        assert r.json() == {"backend": "d0", "path": path, "query": "", "body": body or {}}


async def test_an_unknown_stored_response_is_asked_of_each_d(cluster: MakeCluster) -> None:
    def setup(_ps: list, ds: list) -> None:  # type: ignore[type-arg]
        ds[1].stored.add("resp_1")  # answered before this router started

    c = await cluster(1, 2, setup=setup)
    r = await c.client.get("/v1/responses/resp_1?stream=false")
    assert r.status_code == 200, r.text
    assert r.json()["backend"] == "d1" and r.json()["query"] == "stream=false"
    cancel = await c.client.post("/v1/responses/resp_1/cancel")  # known now: d1 alone
    assert cancel.status_code == 200 and cancel.json()["backend"] == "d1"
    missing = await c.client.get("/v1/responses/resp_2")
    assert missing.status_code == 404 and "resp_2 not found" in missing.text  # D's own 404
    assert len(c.d[0].others) == 2 and len(c.d[1].others) == 3


async def test_an_unserved_path_is_a_json_404_naming_what_is_served(cluster: MakeCluster) -> None:
    c = await cluster(1, 1)
    r = await c.client.post("/v1/embeddings", json={"model": "m", "input": "x"})
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert "POST /v1/embeddings" in message and "POST /v1/responses" in message
    assert c.d[0].others == [] and c.d[0].requests == []
