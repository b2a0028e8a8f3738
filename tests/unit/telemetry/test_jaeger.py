"""The Jaeger v3 reader against a real HTTP server answering in Jaeger's documented format."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from telemetry.jaeger import JaegerClient, JaegerError, rfc3339_nano, unix_ns
from telemetry.schema import Service
from telemetry.traces import read_run
from tests.fixtures.traces import HERE, run_dirs, run_ids
from tests.fixtures.traces.jaeger_server import FakeJaeger, parse_rfc3339_nano

EPOCH = datetime(2020, 1, 1, tzinfo=UTC)  # before every fixture run


@pytest.fixture
def jaeger(request: pytest.FixtureRequest) -> Iterator[FakeJaeger]:
    server = FakeJaeger(getattr(request, "param", HERE / "gen-push")).start()
    try:
        yield server
    finally:
        server.stop()


def _has_router(resource: dict) -> bool:
    return {"key": "service.name", "value": {"stringValue": Service.ROUTER.value}} in resource[
        "attributes"
    ]


def _find_params(server: FakeJaeger) -> list[dict[str, str]]:
    return [
        {k: v[0] for k, v in parse_qs(urlparse(p).query).items()}
        for p in server.requests
        if urlparse(p).path == "/api/v3/traces"
    ]


def test_time_format_round_trips_nanoseconds() -> None:
    ns = 1_796_119_200_123_456_789
    assert rfc3339_nano(ns) == "2026-12-01T10:00:00.123456789Z"
    assert parse_rfc3339_nano(rfc3339_nano(ns)) == ns
    assert unix_ns(datetime(2026, 12, 1, 10, 0, 0, 5, tzinfo=UTC)) == 1_796_119_200_000_005_000


@pytest.mark.parametrize("jaeger", run_dirs(), ids=run_ids(), indirect=True)
def test_find_traces_returns_what_the_files_hold(jaeger: FakeJaeger) -> None:
    client = JaegerClient(jaeger.url)
    got = client.find_traces(Service.ROUTER.value, EPOCH, limit=10_000)
    # a search by service finds the traces holding a span of it (a D leg sent straight to
    # D has none of the router's)
    want = {
        tid: len(sps)
        for tid, sps in jaeger.spans.items()
        if any(_has_router(res) for res, _, _ in sps)
    }
    assert {t.trace_id: len(t.spans) for t in got} == want
    params = _find_params(jaeger)[0]
    assert params["query.service_name"] == Service.ROUTER.value
    assert params["query.start_time_min"].endswith("Z") and params["query.start_time_max"].endswith(
        "Z"
    )
    assert params["query.raw_traces"] == "true"  # Jaeger must not shift spans to "fix" skew


@pytest.mark.parametrize("run_dir", run_dirs(), ids=run_ids())
def test_traces_from_jaeger_equal_traces_from_files(run_dir: Path) -> None:
    server = FakeJaeger(run_dir).start()
    try:
        got = JaegerClient(server.url).find_traces(Service.ROUTER.value, EPOCH, limit=10_000)
    finally:
        server.stop()
    files = [
        t
        for t in read_run(run_dir).traces
        if any(sp.service == Service.ROUTER.value for sp in t.spans)
    ]
    assert [t.trace_id for t in got] == [t.trace_id for t in files]  # both by start time
    for a, b in zip(got, files, strict=True):
        assert a.spans == b.spans  # one parser, one result


def test_paging_narrows_the_window_and_finds_every_trace(jaeger: FakeJaeger) -> None:
    total = len(jaeger.spans)
    assert total > 3, "the fixture needs more traces than one page"
    got = JaegerClient(jaeger.url).find_traces(Service.ROUTER.value, EPOCH, limit=1000, page_size=3)
    assert sorted(t.trace_id for t in got) == sorted(jaeger.spans)  # gen-push: all via the router
    pages = _find_params(jaeger)
    assert len(pages) >= -(-total // 3)
    assert all(int(p["query.search_depth"]) <= 3 + 1 for p in pages)  # + the repeated edge trace
    uppers = [parse_rfc3339_nano(p["query.start_time_max"]) for p in pages]
    assert uppers == sorted(uppers, reverse=True) and uppers[0] > uppers[-1]


def test_limit_caps_the_answer(jaeger: FakeJaeger) -> None:
    got = JaegerClient(jaeger.url).find_traces(Service.ROUTER.value, EPOCH, limit=4, page_size=3)
    assert len(got) == 4 and len({t.trace_id for t in got}) == 4
    depths = [int(p["query.search_depth"]) for p in _find_params(jaeger)]
    assert depths == [3, 2]  # the second page asks for one more: it repeats the edge trace


def test_no_traces_is_empty_not_an_error(jaeger: FakeJaeger) -> None:
    client = JaegerClient(jaeger.url)
    later = datetime(2099, 1, 1, tzinfo=UTC)
    assert client.find_traces(Service.ROUTER.value, later, later + timedelta(hours=1)) == []
    assert client.find_traces("no-such-service", EPOCH) == []
    assert client.get_trace("0" * 31 + "1") is None


def test_get_trace_by_id(jaeger: FakeJaeger) -> None:
    tid = next(iter(jaeger.spans))
    t = JaegerClient(jaeger.url).get_trace(tid.upper())
    assert t is not None and t.trace_id == tid and len(t.spans) == len(jaeger.spans[tid])


def test_services(jaeger: FakeJaeger) -> None:
    assert Service.ROUTER.value in JaegerClient(jaeger.url).services()


def test_missing_window_is_jaegers_400_with_its_message(jaeger: FakeJaeger) -> None:
    client = JaegerClient(jaeger.url)
    with pytest.raises(
        JaegerError, match=r"HTTP 400: query.start_time_min and query.start_time_max are required"
    ):
        client._get("/api/v3/traces", {"query.service_name": "x"})


def test_server_error_says_status_and_message(jaeger: FakeJaeger) -> None:
    jaeger.fail_with = (500, '{"error":{"httpCode":500,"message":"storage is on fire"}}')
    with pytest.raises(JaegerError, match=r"HTTP 500: storage is on fire"):
        JaegerClient(jaeger.url).find_traces(Service.ROUTER.value, EPOCH)


def test_non_json_answer_is_a_clear_error(jaeger: FakeJaeger) -> None:
    jaeger.fail_with = (200, "<html>this is the UI, not the API</html>")
    with pytest.raises(JaegerError, match="not JSON"):
        JaegerClient(jaeger.url).services()


def test_answer_without_result_envelope_is_a_clear_error(jaeger: FakeJaeger) -> None:
    jaeger.fail_with = (200, '{"data": [], "total": 0}')  # the legacy /api/traces shape
    with pytest.raises(JaegerError, match="no 'result'"):
        JaegerClient(jaeger.url).find_traces(Service.ROUTER.value, EPOCH)


def test_unreachable_jaeger_is_a_clear_error() -> None:
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(JaegerError, match=f"cannot reach Jaeger at http://127.0.0.1:{port}"):
            JaegerClient(f"http://127.0.0.1:{port}", timeout_s=2).services()
