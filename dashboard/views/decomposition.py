"""Decomposition view: TTFT segments aggregated over a run, by prompt length or load."""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
import streamlit as st

from dashboard.data import RunData, decomposition, percentiles
from dashboard.views import chart
from dashboard.views.waterfall import SEGMENT_COLORS

GROUPINGS = {
    "prompt length (tokens)": "input_tokens",
    "load (requests in flight at arrival)": "load",
}
COLOR_MAP = {s.value: c for s, c in SEGMENT_COLORS.items()}


def segment_bars(frame: pd.DataFrame, x: str, **kw: Any) -> go.Figure:
    """``frame``'s ``ms`` per ``segment``, stacked in one bar per ``x`` value, in the
    segments' colours (this view's chart and the comparison's)."""
    fig = px.bar(frame, x=x, y="ms", color="segment", color_discrete_map=COLOR_MAP, **kw)
    fig.update_layout(barmode="stack")
    return fig


def render(run: RunData, params: dict[str, str]) -> None:
    measured = run.segments["trace_id"].nunique() if not run.segments.empty else 0
    st.subheader("TTFT decomposition")
    st.caption(
        f"{measured} of {len(run.requests)} requests reached a first token and are "
        "aggregated; bars are means, so each stack adds up to the bucket's mean TTFT."
    )
    if not measured:
        st.info("No request in this source produced a first token.")
        return
    label = st.radio("Group by", list(GROUPINGS), horizontal=True, key="decomp_by")
    params["by"] = GROUPINGS[label]
    long = decomposition(run, GROUPINGS[label])
    fig = segment_bars(
        long,
        "bucket",
        hover_data={"requests": True},
        labels={"bucket": label, "ms": "mean ms"},
        category_orders={"bucket": list(dict.fromkeys(long["bucket"]))},
    )
    fig.update_layout(legend={"orientation": "h", "y": -0.25})
    chart.show(fig, key="decomp_chart")
    st.markdown("**Percentiles (ms)**")
    st.dataframe(
        percentiles(run)
        .style.format("{:.3f}", subset=["p50", "p90", "p99", "mean"])
        .format("{:.0f}", subset=["requests"]),
        key="decomp_percentiles",
    )
    box = px.box(
        run.segments,
        x="segment",
        y="ms",
        color="segment",
        color_discrete_map=COLOR_MAP,
        points=False,
    )
    box.update_layout(showlegend=False, yaxis_type="log", yaxis_title="ms (log)")
    chart.show(box, key="decomp_box")  # box: not in the basic bundle
