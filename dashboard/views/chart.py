"""Drawing a Plotly figure: ``show(fig, key)``, with plotly.js's basic bundle where it can.

Owns: the choice between Streamlit's own ``st.plotly_chart`` and a small in-page component
(``st.components.v2``) that draws the same figure JSON with ``plotly-basic.min.js`` (bar,
scatter, pie: every trace type of the waterfall and the comparison charts), served from
``dashboard/static/`` by Streamlit's static file serving. Why: ``st.plotly_chart`` makes a
browser fetch and compile Streamlit's whole Plotly chunk, about four times the basic bundle
and a large share of a cold first visit (``python -m bench.dashboard_bench``). The component
is used only when static serving is on (``dashboard.launch``, the repository's
``.streamlit/config.toml`` and the Docker image turn it on) and every trace is of a basic
type; otherwise, ``st.plotly_chart`` draws the figure, so a page never lacks a chart.

The vendored file is npm's ``plotly.js-basic-dist-min`` of the plotly.js version that the
installed plotly.py bundles (a unit test keeps them equal).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import streamlit as st
import streamlit.components.v2 as components

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
BASIC_VERSION = "4.1.1"
BASIC_FILE = f"plotly-basic-{BASIC_VERSION}.min.js"
BASIC_SRC = f"app/static/{BASIC_FILE}"  # relative to the page: a server.baseUrlPath works
# what plotly.js's basic bundle draws (its package README)
BASIC_TRACE_TYPES = frozenset({"bar", "scatter", "pie"})
CONFIG: dict[str, Any] = {"displaylogo": False, "responsive": True}

# Loads the bundle once per page (a <script> in <head>: it sets window.Plotly), then draws or
# redraws in place with Plotly.react.
_LOADER = """
function pushkvPlotly(src) {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  if (!window.__pushkvPlotly) {
    window.__pushkvPlotly = new Promise((resolve, reject) => {
      const s = document.createElement("script");
      s.src = new URL(src, document.baseURI).href;
      s.onload = () => resolve(window.Plotly);
      s.onerror = () => {
        window.__pushkvPlotly = null;
        reject(new Error("could not load " + src));
      };
      document.head.appendChild(s);
    });
  }
  return window.__pushkvPlotly;
}
"""
_JS = (
    _LOADER
    + """

export default function({ data, parentElement }) {
  let el = parentElement.querySelector(".pushkv-plot");
  if (!el) {
    el = document.createElement("div");
    el.className = "pushkv-plot";
    parentElement.appendChild(el);
  }
  const fig = JSON.parse(data.figure);
  pushkvPlotly(data.src)
    .then((P) => P.react(el, fig.data, fig.layout || {}, data.config))
    .catch((e) => { el.textContent = "Chart failed: " + e.message; });
}
"""
)

_component = components.component("pushkv_plotly_basic", js=_JS, isolate_styles=False)


def preload(where: Any = st) -> None:
    """Start fetching the bundle as soon as the page shows ``where``'s element, before any
    chart: on a first visit the chart's own component code arrives among the last of
    Streamlit's lazily loaded pieces, so the fetch would start last too."""
    if light_charts_available():
        where.html(
            f"<script>{_LOADER}; pushkvPlotly({json.dumps(BASIC_SRC)}).catch(() => {{}});</script>",
            unsafe_allow_javascript=True,
        )


def basic_types_only(fig: go.Figure) -> bool:
    return all((tr.type or "scatter") in BASIC_TRACE_TYPES for tr in fig.data)


def light_charts_available() -> bool:
    """Static serving is on and the bundle is where it serves from."""
    return bool(st.get_option("server.enableStaticServing")) and (STATIC_DIR / BASIC_FILE).is_file()


def show(fig: go.Figure, key: str, config: dict[str, Any] | None = None) -> None:
    """Draw ``fig`` (full width) under widget key ``key``."""
    cfg = {**CONFIG, **(config or {})}
    if light_charts_available() and basic_types_only(fig):
        _component(data={"figure": fig.to_json(), "src": BASIC_SRC, "config": cfg}, key=key)
    else:
        st.plotly_chart(fig, key=key, config=cfg)
