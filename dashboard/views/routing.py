"""Routing view: how the router spread a run's requests over P and D, why, and whether it paid
off (per kind of choice: what P pushed and the TTFT; per instance: the TTFT distribution)."""

from __future__ import annotations

import pandas as pd
import plotly.express as px
import streamlit as st

from dashboard.data import OK, RunData
from dashboard.routing import Kind, by_instance, by_kind, route_frame
from dashboard.views import chart

KIND_ORDER = [k.value for k in Kind]
# hits green, prefix misses amber/orange, load-only choices blue, no P grey, failures red
KIND_COLORS = {
    Kind.PREFIX_HIT.value: "#2ca02c",
    Kind.HOLDER_BUSY.value: "#ff7f0e",
    Kind.NEW_PREFIX.value: "#f2c14e",
    Kind.SHORT_PROMPT.value: "#9ecae1",
    Kind.ENGINE_LOAD.value: "#1f77b4",
    Kind.LEAST_LOAD.value: "#6baed6",
    Kind.DEGRADED.value: "#7f7f7f",
    Kind.D_ALONE.value: "#bcbcbc",
    Kind.NOT_ROUTED.value: "#d62728",
    Kind.UNRECORDED.value: "#9467bd",
}
ROLES = {"decode": "D", "prefill": "P"}
INSTANCE_FLOATS = ["share_%", "ttft_p50", "ttft_p90", "ttft_p99", "ttft_mean", "pushed_blocks_mean"]


def _headline(routes: pd.DataFrame, kinds: pd.DataFrame) -> None:
    policies = sorted(p for p in routes["policy"].unique() if p)
    cols = st.columns(4)
    cols[0].metric("Requests", len(routes))
    cols[1].metric("Policy", ", ".join(policies) or "not recorded")
    cols[2].metric("D instances", routes["decode"].nunique())
    prefix = routes["kind"].isin(
        [Kind.PREFIX_HIT.value, Kind.HOLDER_BUSY.value, Kind.NEW_PREFIX.value]
    )
    hits = int((routes["kind"] == Kind.PREFIX_HIT.value).sum())
    cols[3].metric("Prefix hits", f"{hits} of {int(prefix.sum())}" if prefix.any() else "-")
    hit, new = Kind.PREFIX_HIT.value, Kind.NEW_PREFIX.value
    if hit in kinds.index and new in kinds.index:
        st.caption(
            f"Prefix hits pushed {kinds.at[hit, 'pushed_blocks_mean']:.1f} blocks on average "
            f"(TTFT p50 {kinds.at[hit, 'ttft_p50']:.1f} ms), new prefixes "
            f"{kinds.at[new, 'pushed_blocks_mean']:.1f} (TTFT p50 "
            f"{kinds.at[new, 'ttft_p50']:.1f} ms)."
        )


def _spread(routes: pd.DataFrame, role: str) -> None:
    counts = routes.groupby([role, "kind"], as_index=False).size()
    fig = px.bar(
        counts,
        x=role,
        y="size",
        color="kind",
        category_orders={"kind": KIND_ORDER},
        color_discrete_map=KIND_COLORS,
        height=320,
        labels={role: f"{ROLES[role]} instance", "size": "requests"},
    )
    fig.update_layout(barmode="stack", legend={"orientation": "h", "y": -0.3})
    chart.show(fig, key=f"routing_spread_{role}")


def _ttft_ecdf(routes: pd.DataFrame) -> None:
    ok = routes[(routes["outcome"] == OK) & routes["ttft_ms"].notna()]
    if ok.empty:
        return
    fig = px.ecdf(ok, x="ttft_ms", color="decode", labels={"ttft_ms": "TTFT ms"}, height=320)
    chart.show(fig, key="routing_ttft_ecdf")


def render(run: RunData, params: dict[str, str]) -> None:
    st.subheader("Routing")
    routes = route_frame(run)
    if routes.empty:
        st.info("No request in this source.")
        return
    kinds = by_kind(routes)
    _headline(routes, kinds)
    st.markdown("**By kind of choice** (TTFT in ms, of the ok requests)")
    st.dataframe(
        kinds.style.format("{:.1f}", na_rep="-")
        .format("{:.0f}", subset=["requests"])
        .format("{:,.0f}", na_rep="-", subset=["pushed_bytes_mean"]),
        key="routing_kinds",
    )
    for role in ROLES:
        st.markdown(f"**Per {ROLES[role]} instance**")
        _spread(routes, role)
        st.dataframe(
            by_instance(routes, role).style.format("{:.1f}", na_rep="-", subset=INSTANCE_FLOATS),
            key=f"routing_{role}",
        )
        if role == "decode":
            _ttft_ecdf(routes)
    st.markdown("**Requests** (arrival order; hover a reason to read it whole)")
    st.dataframe(routes, key="routing_requests", hide_index=True)
