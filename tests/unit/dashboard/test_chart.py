"""dashboard.views.chart: which figures take the plotly-basic component, and the fallback."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import plotly
import plotly.express as px
import pytest
from streamlit import config
from streamlit.testing.v1 import AppTest

from dashboard.data import load_run_folder
from dashboard.views import chart
from dashboard.views.waterfall import waterfall_figure
from tests.fixtures.traces import HERE

APP = str(Path(__file__).resolve().parents[3] / "dashboard" / "app.py")


def _bundled_plotly_js_version() -> str | None:
    """The plotly.js version inside the installed plotly.py (its file's header)."""
    head = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text()[:300]
    m = re.search(r"plotly\.js v(\d+\.\d+\.\d+)", head)
    return m.group(1) if m else None


def test_vendored_bundle_is_the_plotly_js_that_plotly_py_bundles() -> None:
    # plotly.py writes figure JSON for its own plotly.js: the basic bundle must be that version
    assert _bundled_plotly_js_version() == chart.BASIC_VERSION
    head = (chart.STATIC_DIR / chart.BASIC_FILE).read_text()[:200]
    assert f"plotly.js (basic - minified) v{chart.BASIC_VERSION}" in head


def test_only_figures_of_basic_trace_types_take_the_light_bundle() -> None:
    data = load_run_folder(HERE / "gen-push")
    tid = data.requests["trace_id"].iloc[0]
    assert chart.basic_types_only(waterfall_figure(data.traces[tid], data.paths[tid]))
    assert chart.basic_types_only(px.ecdf(data.requests, x="ttft_ms"))
    assert not chart.basic_types_only(px.box(data.segments, x="segment", y="ms"))


@pytest.fixture
def static_serving_off() -> Iterator[None]:
    before = config.get_option("server.enableStaticServing")
    config.set_option("server.enableStaticServing", False)
    try:
        yield
    finally:
        config.set_option("server.enableStaticServing", before)


def _kinds(at: AppTest, key: str) -> set[str]:
    return {
        kind
        for kind in ("plotly_chart", "bidi_component")
        for el in at.get(kind)
        if el.proto.id.endswith(f"-{key}")
    }


def _run(view: str) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params["run"] = str(HERE / "gen-push")
    at.query_params["view"] = view
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_with_static_serving_the_waterfall_is_the_component_and_box_plots_stay() -> None:
    assert config.get_option("server.enableStaticServing"), (
        "the repository's .streamlit/config.toml"
    )
    at = _run("requests")
    assert _kinds(at, "waterfall") == {"bidi_component"}
    el = next(el for el in at.get("bidi_component") if el.proto.id.endswith("-waterfall"))
    payload = json.loads(el.proto.json)
    assert payload["src"] == f"app/static/{chart.BASIC_FILE}"  # relative: baseUrlPath works
    assert (chart.STATIC_DIR / chart.BASIC_FILE).is_file()
    assert json.loads(payload["figure"])["data"], "the figure travels whole"
    at = _run("decomposition")
    assert _kinds(at, "decomp_chart") == {"bidi_component"}
    assert _kinds(at, "decomp_box") == {"plotly_chart"}  # box is not in the basic bundle


def test_without_static_serving_every_chart_is_st_plotly_chart(static_serving_off: None) -> None:
    at = _run("requests")
    assert _kinds(at, "waterfall") == {"plotly_chart"}
    assert not at.get("bidi_component")
