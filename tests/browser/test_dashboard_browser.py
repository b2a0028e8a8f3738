"""The dashboard in a real headless Chromium: the waterfall and the decomposition render, and
a response's trace id (a link or the pasted ``traceresponse``) opens that request."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlencode

import pytest

from dashboard.data import load_run_folder
from dashboard.views import chart
from telemetry.schema import Service
from tests.browser.conftest import LAUNCH_RUN
from tests.fixtures.traces import run_dirs, run_ids

pytestmark = pytest.mark.browser
WAIT_MS = 60_000


def _open(browser, url: str, tmp_path: Path, name: str):  # type: ignore[no-untyped-def]
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url, wait_until="domcontentloaded")
    return page, errors


@pytest.mark.parametrize("run_dir", run_dirs(), ids=run_ids())
def test_waterfall_renders(dashboard_url: str, browser, run_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data = load_run_folder(run_dir)
    first = data.requests.iloc[0]
    page, errors = _open(
        browser, f"{dashboard_url}/?{urlencode({'run': str(run_dir)})}", tmp_path, "req"
    )
    try:
        page.get_by_text(f"Critical path: {first['request_id']}").wait_for(timeout=WAIT_MS)
        page.locator("[data-testid='stDataFrame']").first.wait_for(timeout=WAIT_MS)
        bars = page.locator(".js-plotly-plot .barlayer .point path")
        bars.first.wait_for(timeout=WAIT_MS)
        spans = len(data.traces[first["trace_id"]].spans)
        path = data.paths[first["trace_id"]]
        segments = len(path.segments) if path else 0
        assert bars.count() == spans + segments, (
            "one bar per span plus one per critical-path segment"
        )
        assert "trace=" + first["trace_id"] in page.url  # the link to this request is in the URL
        # drawn by plotly.js's basic bundle (dashboard.views.chart), not Streamlit's 4.7 MB one
        assert page.evaluate("window.Plotly && window.Plotly.version") == chart.BASIC_VERSION
        page.screenshot(path=str(tmp_path / f"waterfall-{run_dir.name}.png"), full_page=True)
        assert not errors, errors
    finally:
        page.close()


@pytest.mark.parametrize("run_dir", run_dirs(), ids=run_ids())
def test_decomposition_renders(dashboard_url: str, browser, run_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data = load_run_folder(run_dir)
    q = urlencode({"run": str(run_dir), "view": "decomposition"})
    page, errors = _open(browser, f"{dashboard_url}/?{q}", tmp_path, "decomp")
    try:
        page.get_by_text("TTFT decomposition", exact=True).first.wait_for(timeout=WAIT_MS)
        bars = page.locator(".js-plotly-plot .barlayer .point path")
        # a zero-length segment (no connect span: a connection already open) draws a bar
        # of no height, which never becomes visible: wait for one that has a height
        page.locator(".js-plotly-plot .barlayer .point path >> visible=true").first.wait_for(
            timeout=WAIT_MS
        )
        n_segments = data.segments["segment"].nunique()
        assert bars.count() >= n_segments
        legend = page.locator(".js-plotly-plot .legend .legendtext").all_text_contents()
        assert set(data.segments["segment"]) <= {t.strip() for t in legend}
        page.screenshot(path=str(tmp_path / f"decomposition-{run_dir.name}.png"), full_page=True)
        assert not errors, errors
    finally:
        page.close()


def test_clicking_a_row_opens_that_request(dashboard_url: str, browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    run_dir = next(d for d in run_dirs() if len(load_run_folder(d).requests) >= 2)
    data = load_run_folder(run_dir)
    second = data.requests.iloc[1]
    page, errors = _open(
        browser, f"{dashboard_url}/?{urlencode({'run': str(run_dir)})}", tmp_path, "click"
    )
    try:
        page.get_by_text(f"Critical path: {data.requests.iloc[0]['request_id']}").wait_for(
            timeout=WAIT_MS
        )
        # the page has settled (chart drawn) and the grid's canvas is up: a click now lands
        page.locator(".js-plotly-plot .barlayer .point path").first.wait_for(timeout=WAIT_MS)
        page.locator("[data-testid='stDataFrame'] canvas").first.wait_for(timeout=WAIT_MS)
        grid = page.locator("[data-testid='stDataFrame']").first
        box = grid.bounding_box()
        assert box is not None
        # the grid is a canvas: click the selection cell of the second data row (35 px rows)
        page.mouse.click(box["x"] + 15, box["y"] + 35 + 35 + 17)
        page.get_by_text(f"Critical path: {second['request_id']}").wait_for(timeout=WAIT_MS)
        page.wait_for_url(f"**trace={second['trace_id']}**", timeout=WAIT_MS)
        assert not errors, errors
    finally:
        page.close()


def test_exports_download_as_chrome_trace_json(
    dashboard_url: str,
    browser,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    run_dir = run_dirs()[0]
    data = load_run_folder(run_dir)
    first = data.requests.iloc[0]
    page, errors = _open(
        browser, f"{dashboard_url}/?{urlencode({'run': str(run_dir)})}", tmp_path, "dl"
    )
    try:
        page.get_by_text(f"Critical path: {first['request_id']}").wait_for(timeout=WAIT_MS)
        one = len(data.traces[first["trace_id"]].spans)
        every = sum(len(t.spans) for t in data.traces.values())
        for label, spans in (
            ("Export trace (Perfetto JSON)", one),
            ("Export run (Perfetto JSON)", every),
        ):
            with page.expect_download(timeout=WAIT_MS) as dl:
                page.get_by_role("button", name=label).click()
            doc = json.loads(Path(dl.value.path()).read_text())
            slices = [
                e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] != "critical path"
            ]
            assert len(slices) == spans, label
        assert not errors, errors
    finally:
        page.close()


def test_span_labels_fit_and_no_deploy_button(dashboard_url: str, browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    run_dir, trace_id = next(
        (d, tid)
        for d in run_dirs()
        for tid, t in load_run_folder(d).traces.items()
        if any(sp.name.endswith("rendezvous_wait") for sp in t.spans)
    )
    q = urlencode({"run": str(run_dir), "trace": trace_id})
    page, errors = _open(browser, f"{dashboard_url}/?{q}", tmp_path, "labels")
    try:
        page.locator(".js-plotly-plot .ytick text").first.wait_for(timeout=WAIT_MS)
        plot = page.locator(".js-plotly-plot .main-svg").first.bounding_box()
        labels = page.locator(".js-plotly-plot .ytick text")
        boxes = [labels.nth(i).bounding_box() for i in range(labels.count())]
        assert plot is not None and boxes
        clipped = [
            labels.nth(i).text_content()
            for i, b in enumerate(boxes)
            if b is None or b["x"] < plot["x"] - 0.5
        ]
        assert not clipped, f"row labels run off the chart's left edge: {clipped}"
        assert any(
            "rendezvous_wait" in (labels.nth(i).text_content() or "") for i in range(len(boxes))
        )
        assert page.get_by_text("Deploy", exact=True).count() == 0, "Streamlit's Deploy button"
        page.screenshot(path=str(tmp_path / "labels.png"), full_page=True)
        assert not errors, errors
    finally:
        page.close()


def _push_request_not_shown_first() -> tuple[str, str, int]:
    """(trace id, request id, bars of its waterfall) of a push request with P's and D's
    spans that the page does not open by itself."""
    data = load_run_folder(LAUNCH_RUN)
    for _, row in data.requests.iloc[1:].iterrows():
        trace, path = data.traces[row["trace_id"]], data.paths[row["trace_id"]]
        services = {sp.resource.get("service.name") for sp in trace.spans}
        if path and {Service.PREFILL.value, Service.DECODE.value} <= services:
            return row["trace_id"], row["request_id"], len(trace.spans) + len(path.segments)
    raise AssertionError(f"{LAUNCH_RUN} has no push request with P's and D's spans")


def test_a_trace_id_in_the_url_opens_that_request(
    dashboard_url: str,
    browser,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    trace_id, request_id, bars = _push_request_not_shown_first()
    # the link the docs and Grafana's exemplars give: the trace id alone, no run named
    page, errors = _open(browser, f"{dashboard_url}/?trace={trace_id}", tmp_path, "url")
    try:
        page.get_by_text(f"Critical path: {request_id}").wait_for(timeout=WAIT_MS)
        drawn = page.locator(".js-plotly-plot .barlayer .point path")
        drawn.first.wait_for(timeout=WAIT_MS)
        assert drawn.count() == bars, "the waterfall of that request: its spans and segments"
        page.wait_for_url(f"**trace={trace_id}**", timeout=WAIT_MS)
        page.screenshot(path=str(tmp_path / "by-trace-id.png"), full_page=True)
        assert not errors, errors
    finally:
        page.close()


def test_a_pasted_traceresponse_opens_that_request(
    dashboard_url: str,
    browser,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    trace_id, request_id, _ = _push_request_not_shown_first()
    first = load_run_folder(LAUNCH_RUN).requests.iloc[0]["request_id"]
    page, errors = _open(browser, f"{dashboard_url}/?view=decomposition", tmp_path, "paste")
    try:
        page.get_by_text("TTFT decomposition", exact=True).first.wait_for(timeout=WAIT_MS)
        box = page.get_by_role("textbox", name="Open a trace id")
        box.fill(f"00-{trace_id}-00f067aa0ba902b7-01")  # as the router's header has it
        box.press("Enter")
        page.get_by_text(f"Critical path: {request_id}").wait_for(timeout=WAIT_MS)
        page.wait_for_url(f"**trace={trace_id}**", timeout=WAIT_MS)
        assert page.get_by_text(f"Critical path: {first}").count() == 0
        assert not errors, errors
    finally:
        page.close()
