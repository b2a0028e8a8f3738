"""Comparison view: two runs side by side (push vs pull, before vs after)."""

from __future__ import annotations

import pandas as pd
import plotly.express as px
import streamlit as st

from dashboard.data import OK, RunData, percentiles
from dashboard.state import RUN, Source, initial_source, known_runs, load
from dashboard.views import chart, kv, sweep_compare
from dashboard.views.decomposition import segment_bars
from dashboard.views.source import source_params, source_picker
from telemetry.jaeger import JaegerError
from telemetry.traces import RunFolderError


def _default_b(a: RunData) -> Source:
    """``b_run``/``b_jaeger`` from the link, else another known run than A."""
    src = initial_source("b_")
    if "b_run" in st.query_params or "b_jaeger" in st.query_params:
        return src
    others = [r for r in known_runs(a.label) if r != a.label]
    return Source(RUN, others[0]) if others else Source(RUN, a.label)


def _short(label: str) -> str:
    return label.rstrip("/").rsplit("/", 1)[-1] or label


def table(a: RunData, b: RunData) -> pd.DataFrame:
    """p50/p90/p99 of TTFT and mean of each segment, A and B, and B / A."""
    pa, pb = percentiles(a), percentiles(b)
    rows = []
    for stat in ("p50", "p90", "p99"):
        rows.append(
            (
                f"TTFT {stat}",
                pa.at["TTFT", stat] if "TTFT" in pa.index else None,
                pb.at["TTFT", stat] if "TTFT" in pb.index else None,
            )
        )
    for seg in dict.fromkeys([*pa.index, *pb.index]):
        if seg != "TTFT":
            rows.append(
                (
                    f"{seg} mean",
                    pa.at[seg, "mean"] if seg in pa.index else None,
                    pb.at[seg, "mean"] if seg in pb.index else None,
                )
            )
    df = pd.DataFrame(rows, columns=["ms", "A", "B"]).astype({"A": float, "B": float})
    df["B / A"] = df["B"] / df["A"]
    failed = {
        "ms": "failed requests",
        "A": float((a.requests["outcome"] != OK).sum()),
        "B": float((b.requests["outcome"] != OK).sum()),
        "B / A": float("nan"),
    }
    return pd.concat([df, pd.DataFrame([failed])], ignore_index=True)


def render(run: RunData, params: dict[str, str]) -> None:
    st.subheader("Compare two runs")
    left, right = st.columns(2)
    left.markdown(f"**A:** `{run.label}` ({len(run.requests)} requests)")
    src_b = source_picker(right, "b_", _default_b(run))
    params.update(source_params(src_b, "b_"))
    try:
        other = load(src_b)
    except (RunFolderError, JaegerError) as e:
        st.error(f"B: {e}")
        sweep_compare.render([run.label], params)
        return
    right.markdown(f"**B:** `{other.label}` ({len(other.requests)} requests)")
    rows = table(run, other)
    st.dataframe(
        rows.style.format("{:.3f}", subset=["A", "B", "B / A"], na_rep="-"),
        hide_index=True,
        key="compare_table",
        height=35 * (len(rows) + 1) + 3,
    )
    kv.compare_table(run, other)
    a_name, b_name = f"A: {_short(run.label)}", f"B: {_short(other.label)}"
    ttft = pd.concat([run.requests.assign(run=a_name), other.requests.assign(run=b_name)])
    ttft = ttft.dropna(subset=["ttft_ms"])
    if not ttft.empty:
        chart.show(
            px.ecdf(ttft, x="ttft_ms", color="run", labels={"ttft_ms": "TTFT ms"}),
            key="compare_ecdf",
        )
    segs = pd.concat([run.segments.assign(run=a_name), other.segments.assign(run=b_name)])
    if not segs.empty:
        per_request = segs.groupby(["run", "trace_id", "segment"], as_index=False)["ms"].sum()
        wide = per_request.pivot_table(
            index=["run", "trace_id"], columns="segment", values="ms", fill_value=0.0
        )
        means = (
            wide.groupby(level="run")
            .mean()
            .reset_index()
            .melt(id_vars="run", var_name="segment", value_name="ms")
        )
        fig = segment_bars(means, "run", labels={"ms": "mean ms"}, title="Mean TTFT decomposition")
        chart.show(fig, key="compare_bars")
    sweep_compare.render([run.label, other.label], params)
