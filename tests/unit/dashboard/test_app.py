"""Every view of the dashboard through Streamlit's AppTest, on every fixture run."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from dashboard.data import load_run_folder
from telemetry.schema import Attr, Span
from tests.fixtures.traces import HERE, run_dirs, run_ids
from tests.fixtures.traces.jaeger_server import FakeJaeger

APP = str(Path(__file__).resolve().parents[3] / "dashboard" / "app.py")
VIEWS = ["requests", "decomposition", "routing", "compare"]


def run_app(**query: str) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60)
    for k, v in query.items():
        at.query_params[k] = v
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def chart(at: AppTest, key: str) -> dict:
    """The figure JSON of chart ``key``, drawn by st.plotly_chart or dashboard.views.chart's
    plotly-basic component (AppTest reads the repository's .streamlit/config.toml, which
    turns static serving on)."""
    for el in at.get("plotly_chart"):
        if el.proto.id.endswith(f"-{key}"):  # element ids end with the widget key
            return json.loads(el.proto.spec)
    for el in at.get("bidi_component"):
        if el.proto.id.endswith(f"-{key}"):
            return json.loads(json.loads(el.proto.json)["figure"])
    raise AssertionError(f"no plotly chart {key!r} on the page")


@pytest.mark.parametrize("run_dir", run_dirs(), ids=run_ids())
def test_requests_view_lists_every_request_and_draws_its_waterfall(run_dir: Path) -> None:
    at = run_app(run=str(run_dir), view="requests")
    data = load_run_folder(run_dir)
    table = at.dataframe[0].value
    assert len(table) == len(data.traces) - data.not_requests
    assert list(table["outcome"] != "ok") == sorted(
        table["outcome"] != "ok", reverse=True
    )  # failed first
    assert not at.error
    trace_id = at.query_params["trace"]
    assert trace_id == table["trace_id"].iloc[0]  # the first request needing attention is open
    fig = chart(at, "waterfall")
    bars = [
        y
        for tr in fig["data"]
        if tr["type"] == "bar" and tr["name"] != "critical path"
        for y in tr["y"]
    ]
    assert len(bars) == len(data.traces[trace_id].spans)
    assert at.subheader[0].value.startswith("Critical path: ")
    assert at.get("download_button"), "no Perfetto export button"


@pytest.mark.parametrize("run_dir", run_dirs(), ids=run_ids())
def test_decomposition_view_stacks_segments_and_lists_percentiles(run_dir: Path) -> None:
    at = run_app(run=str(run_dir), view="decomposition")
    data = load_run_folder(run_dir)
    if data.segments.empty:
        assert at.info, "a run without first tokens says so"
        return
    fig = chart(at, "decomp_chart")
    segments_drawn = {tr["name"] for tr in fig["data"]}
    assert segments_drawn == set(data.segments["segment"])
    pct = at.dataframe[0].value
    assert "TTFT" in list(pct.index) and {"p50", "p90", "p99"} <= set(pct.columns)
    at.radio(key="decomp_by").set_value("load (requests in flight at arrival)").run()
    assert not at.exception and at.query_params["by"] == "load"


def test_compare_view_shows_both_runs() -> None:
    at = run_app(run=str(HERE / "gen-push"), b_run=str(HERE / "gen-pull"), view="compare")
    table = at.dataframe[0].value
    assert {"A", "B", "B / A"} <= set(table.columns)
    assert "TTFT p50" in list(table["ms"]) and "failed requests" in list(table["ms"])
    assert table.loc[table["ms"] == "P prefill mean", "B"].isna().all()  # pull has no P spans
    chart(at, "compare_ecdf")
    chart(at, "compare_bars")
    assert at.query_params["b_run"] == str(HERE / "gen-pull")


def test_the_open_request_and_the_comparison_show_the_kv_geometry() -> None:
    at = run_app(run=str(HERE / "gen-push-tp2"), view="requests")
    (kv,) = [d.value for d in at.dataframe if "bytes_per_token" in d.value.columns]
    assert len(kv) == 2 and set(kv["tp_rank"]) == {0, 1}  # one row per P rank's WRITE
    assert set(kv["dtype"]) == {"bfloat16"} and (kv["bytes_per_token"] == 8192).all()
    at = run_app(run=str(HERE / "gen-push"), b_run=str(HERE / "gen-push-tp2"), view="compare")
    (rows,) = [d.value for d in at.dataframe if "median" in d.value.columns]
    bpt = rows.set_index("median").loc["KV bytes per token (P ranks summed)"]
    assert (bpt["A"], bpt["B"]) == (16384, 16384)  # TP 2's ranks sum to the same model
    assert any("8 layers · 8 heads x 64" in c.value for c in at.caption)


def test_link_to_one_request_opens_it() -> None:
    data = load_run_folder(HERE / "gen-push")
    ok = data.requests[data.requests["outcome"] == "ok"].iloc[-1]
    at = run_app(run=str(HERE / "gen-push"), trace=ok["trace_id"])
    assert ok["request_id"] in at.subheader[0].value
    at = run_app(run=str(HERE / "gen-push"), req=ok["request_id"])
    assert at.query_params["trace"] == ok["trace_id"]
    link = next(m.value for m in at.markdown if "trace=" in m.value)
    assert f"trace={ok['trace_id']}" in link and "run=" in link


def test_choosing_another_request_updates_the_link() -> None:
    at = run_app(run=str(HERE / "gen-push"))
    options = at.selectbox(key="trace").options
    at.selectbox(key="trace").select_index(len(options) - 1).run()
    assert not at.exception
    chosen = at.selectbox(key="trace").value
    assert (
        at.query_params["trace"] == chosen and chosen != at.dataframe[0].value["trace_id"].iloc[0]
    )


def test_filters_narrow_the_table() -> None:
    at = run_app(run=str(HERE / "gen-push"))
    at.multiselect(key="f_outcome").set_value(["ok"]).run()
    table = at.dataframe[0].value
    assert len(table) and set(table["outcome"]) == {"ok"}
    at.number_input(key="f_ttft").set_value(50.0).run()
    table = at.dataframe[0].value
    assert (table["ttft_ms"] >= 50).all() and len(table) < len(
        load_run_folder(HERE / "gen-push").requests
    )


def test_failed_request_shows_its_reason() -> None:
    at = run_app(run=str(HERE / "gen-push"))  # a failed request opens first
    assert "write_error" in at.subheader[0].value or "cancelled" in at.subheader[0].value
    assert any("No first token" in i.value for i in at.info)


def test_missing_folder_is_an_error_message_not_a_crash(tmp_path: Path) -> None:
    at = run_app(run=str(tmp_path / "nope"))
    assert "does not exist" in at.error[0].value


@pytest.fixture
def jaeger() -> Iterator[FakeJaeger]:
    server = FakeJaeger(HERE / "gen-push").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("run_dir", run_dirs(), ids=run_ids())
def test_routing_view_lists_every_request_with_its_kind_of_choice(run_dir: Path) -> None:
    at = run_app(run=str(run_dir), view="routing")
    data = load_run_folder(run_dir)
    assert not at.error
    requests = at.dataframe[-1].value
    assert len(requests) == len(data.requests) and set(requests["trace_id"]) == set(
        data.requests["trace_id"]
    )
    assert requests["kind"].notna().all()
    assert set(at.dataframe[0].value.index) == set(requests["kind"])  # the per-kind table
    spread = chart(at, "routing_spread_decode")
    drawn = sum(_numbers(tr["y"]).sum() for tr in spread["data"])
    assert drawn == len(data.requests)  # every request is in one bar
    assert {x for tr in spread["data"] for x in tr["x"]} == set(requests["decode"])


def _numbers(values: object) -> np.ndarray:
    """A figure's numeric array: a list, or plotly's typed array ({"dtype", "bdata"})."""
    if isinstance(values, dict):
        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"])
    return np.asarray(values, dtype=float)


@pytest.mark.parametrize("view", VIEWS)
def test_views_read_jaeger(jaeger: FakeJaeger, view: str) -> None:
    at = run_app(jaeger=jaeger.url, lookback="5000000", view=view, b_run=str(HERE / "gen-pull"))
    assert not at.error, [e.value for e in at.error]
    if view == "requests":
        assert len(at.dataframe[0].value) == len(jaeger.spans)
    assert any(p.startswith("/api/v3/traces?") for p in jaeger.requests)


def test_unreachable_jaeger_is_an_error_message(jaeger: FakeJaeger) -> None:
    url = jaeger.url
    jaeger.stop()
    at = run_app(jaeger=url)
    assert "cannot reach Jaeger" in at.error[0].value


def test_span_attributes_are_inspectable() -> None:
    at = run_app(run=str(HERE / "gen-push-tp2"))
    labels = at.selectbox(key="span_pick").options  # as shown: formatted
    write = next(i for i, lab in enumerate(labels) if lab.endswith("· write"))
    at.selectbox(key="span_pick").set_value(write).run()
    shown = at.json[0].value
    assert Span.WRITE.value in shown and Attr.BYTES.value in shown


def test_switching_the_source_resets_filters_and_selection() -> None:
    at = run_app(run=str(HERE / "gen-push-tp2"))
    at.multiselect(key="f_outcome").set_value(["ok"]).run()
    at.selectbox(key="span_pick").set_value(len(at.selectbox(key="span_pick").options) - 1).run()
    assert str(HERE / "gen-pull") in at.selectbox(key="run").options  # sibling runs are offered
    at.selectbox(key="run").set_value(str(HERE / "gen-pull")).run()
    assert not at.exception and not at.error
    pull = load_run_folder(HERE / "gen-pull")
    assert len(at.dataframe[0].value) == len(pull.requests)
    assert (
        at.query_params["run"] == str(HERE / "gen-pull") and at.query_params["trace"] in pull.traces
    )


@pytest.mark.parametrize("view", VIEWS)
def test_a_run_with_no_spans_yet_renders_every_view(tmp_path: Path, view: str) -> None:
    (tmp_path / "traces-pushkv-router-1.jsonl").write_text("")  # a process started, nothing ended
    at = run_app(run=str(tmp_path), view=view, b_run=str(tmp_path))
    assert not at.error
    if view != "compare":
        assert at.info, "says there is nothing to show"


def test_non_streamed_request_says_what_stream_back_holds(tmp_path: Path) -> None:
    on = json.dumps({"key": Attr.STREAM.value, "value": {"boolValue": True}}, separators=(",", ":"))
    for f in (HERE / "gen-push").glob("traces-*.jsonl"):
        (tmp_path / f.name).write_text(f.read_text().replace(on, on.replace("true", "false")))
    data = load_run_folder(tmp_path)
    ok = data.requests[data.requests["outcome"] == "ok"].iloc[0]
    assert not bool(ok["stream"])
    at = run_app(run=str(tmp_path), trace=ok["trace_id"])
    assert any("Not streamed" in i.value for i in at.info)


def test_segment_table_shows_milliseconds_and_shares_with_sensible_precision() -> None:
    at = run_app(run=str(run_dirs()[0]), view="requests")
    (segments,) = [d for d in at.dataframe if "share_%" in d.value.columns]
    columns = json.loads(segments.proto.columns)
    assert columns["ms"]["type_config"]["format"] == "%.3f"
    assert columns["start_ms"]["type_config"]["format"] == "%.3f"
    assert columns["share_%"]["type_config"]["format"] == "%.1f %%"


def _an_ok_request_not_shown_first(run_dir: Path) -> tuple[str, str]:
    data = load_run_folder(run_dir)
    ok = data.requests[data.requests["outcome"] == "ok"].iloc[-1]
    assert ok["trace_id"] != data.requests.iloc[0]["trace_id"]
    return str(ok["trace_id"]), str(ok["request_id"])


def test_pasting_a_traceresponse_opens_that_request() -> None:
    trace_id, request_id = _an_ok_request_not_shown_first(HERE / "gen-push")
    at = run_app(run=str(HERE / "gen-push"), view="decomposition")
    at.text_input(key="open_trace").set_value(f" 00-{trace_id.upper()}-00f067aa0ba902b7-01 ").run()
    assert not at.exception and not at.sidebar.error
    assert request_id in at.subheader[0].value
    assert at.query_params["trace"] == trace_id and at.query_params["view"] == "requests"
    # the box opened it once: a request chosen afterwards stays chosen
    at.selectbox(key="trace").select_index(0).run()
    other = at.selectbox(key="trace").value
    assert at.query_params["trace"] == other != trace_id


def test_a_pasted_non_id_says_so() -> None:
    at = run_app(run=str(HERE / "gen-push"))
    at.text_input(key="open_trace").set_value("cmpl-42").run()
    assert "Not a trace id" in at.sidebar.error[0].value


def test_a_link_to_a_trace_not_in_the_source_says_so() -> None:
    at = run_app(run=str(HERE / "gen-push"), trace="ab" * 16)
    assert any("ab" * 16 in w.value and "not among the traces" in w.value for w in at.warning)
    assert at.query_params["trace"] == at.dataframe[0].value["trace_id"].iloc[0]


def test_a_link_opens_a_jaeger_trace_older_than_the_window(jaeger: FakeJaeger) -> None:
    trace_id, request_id = _an_ok_request_not_shown_first(HERE / "gen-push")
    at = run_app(jaeger=jaeger.url, lookback="1", trace=trace_id)  # fixtures are older
    assert not at.error, [e.value for e in at.error]
    assert request_id in at.subheader[0].value
    assert f"/api/v3/traces/{trace_id}?raw_traces=true" in jaeger.requests
