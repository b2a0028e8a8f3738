"""The per-request waterfall: one row per span, grouped by instance, critical path on top.

Owns: building the Plotly figure (pure; ``render`` only draws it). Rows are grouped by the
process that emitted them (router, each P rank, D) in order of first activity; bars on the
critical path are drawn solid with an outline, the rest faded; span events are markers; the
top row is the TTFT decomposition itself, unknown segments grey, negative ones red. Times are
milliseconds since the request arrived at the router.
"""

from __future__ import annotations

import html

import plotly.graph_objects as go

from telemetry.critical_path import CriticalPath, Seg
from telemetry.otlp_json import SpanRecord, Trace
from telemetry.schema import Resource
from telemetry.traces import instance_label

PATH_ROW = "TTFT critical path"
# the same role keeps its colour in every trace (P ranks and several Ds take the next shade)
ROLE_COLORS = {
    "router": ["#4C78A8", "#72B7B2"],
    "prefill": ["#F58518", "#E45756", "#9D755D", "#FF9DA6"],
    "decode": ["#54A24B", "#88D27A", "#B279A2"],
}
OTHER_COLORS = ["#7F7F7F", "#BAB0AC", "#B279A2"]
SEGMENT_COLORS = {
    Seg.CONNECT: "#deebf7",
    Seg.INGRESS: "#c6dbef",
    Seg.ROUTER: "#9ecae9",
    Seg.P_QUEUE: "#ffbf79",
    Seg.P_PREFILL: "#f58518",
    Seg.RENDEZVOUS: "#e45756",
    Seg.DESCRIPTORS: "#b279a2",
    Seg.WRITE: "#d62728",
    Seg.NOTIFY: "#88d27a",
    Seg.D_STEP: "#54a24b",
    Seg.STREAM_BACK: "#4c78a8",
    Seg.P_ANSWER: "#9d755d",
    Seg.PREFILL_LEG: "#f58518",
    Seg.DECODE_LEG: "#54a24b",
    Seg.UNKNOWN: "#c7c7c7",
}


def _short(name: str) -> str:
    return name.split(".", 1)[-1]


def _hover(sp: SpanRecord, origin: int) -> str:
    lines = [
        f"<b>{html.escape(sp.name)}</b> ({html.escape(instance_label(sp))})",
        f"{(sp.start_ns - origin) / 1e6:.3f} -> {(sp.end_ns - origin) / 1e6:.3f} ms "
        f"({sp.duration_ns / 1e6:.3f} ms)",
    ]
    if sp.is_error:
        lines.append(f"<b>ERROR</b> {html.escape(sp.status_message)}")
    lines += [f"{html.escape(k)} = {html.escape(str(v))}" for k, v in sorted(sp.attributes.items())]
    lines += [
        f"event {html.escape(ev.name)} @ {(ev.time_ns - origin) / 1e6:.3f} ms" for ev in sp.events
    ]
    return "<br>".join(lines)


def row_labels(trace: Trace) -> list[tuple[str, SpanRecord]]:
    """(row label, span) grouped by instance (first active first), by start inside a group."""
    groups: dict[str, list[SpanRecord]] = {}
    for sp in trace.spans:  # spans are sorted by start, so groups come in order of activity
        groups.setdefault(instance_label(sp), []).append(sp)
    rows: list[tuple[str, SpanRecord]] = []
    seen: dict[str, int] = {}
    for inst, spans in groups.items():
        for sp in spans:
            label = f"{inst} · {_short(sp.name)}"
            seen[label] = seen.get(label, 0) + 1
            rows.append((label if seen[label] == 1 else f"{label} #{seen[label]}", sp))
    return rows


def waterfall_figure(trace: Trace, path: CriticalPath | None) -> go.Figure:
    origin = path.start_ns if path else trace.start_ns
    rows = row_labels(trace)
    fig = go.Figure()
    colors: dict[str, str] = {}
    used: dict[str, int] = {}
    for _, sp in rows:
        inst = instance_label(sp)
        if inst not in colors:
            role = str(sp.resource.get(Resource.ROLE.value, ""))
            palette = ROLE_COLORS.get(role, OTHER_COLORS)
            colors[inst] = palette[used.get(role, 0) % len(palette)]
            used[role] = used.get(role, 0) + 1
    for inst, color in colors.items():
        mine = [(label, sp) for label, sp in rows if instance_label(sp) == inst]
        on_path = [path is not None and path.on_path(sp) for _, sp in mine]
        fig.add_trace(
            go.Bar(
                name=inst,
                orientation="h",
                y=[label for label, _ in mine],
                base=[(sp.start_ns - origin) / 1e6 for _, sp in mine],
                x=[max(sp.duration_ns, 0) / 1e6 for _, sp in mine],
                marker={
                    "color": color,
                    "opacity": [1.0 if c else 0.45 for c in on_path],
                    "line": {
                        "color": [
                            "#d62728" if sp.is_error else "#222" if c else color
                            for (_, sp), c in zip(mine, on_path, strict=True)
                        ],
                        "width": [
                            2.5 if c or sp.is_error else 0
                            for (_, sp), c in zip(mine, on_path, strict=True)
                        ],
                    },
                },
                hovertext=[_hover(sp, origin) for _, sp in mine],
                hoverinfo="text",
                customdata=[sp.span_id for _, sp in mine],
            )
        )
    ev_x, ev_y, ev_text = [], [], []
    for label, sp in rows:
        for ev in sp.events:
            ev_x.append((ev.time_ns - origin) / 1e6)
            ev_y.append(label)
            ev_text.append(f"{html.escape(ev.name)} @ {(ev.time_ns - origin) / 1e6:.3f} ms")
    if ev_x:
        fig.add_trace(
            go.Scatter(
                name="events",
                x=ev_x,
                y=ev_y,
                mode="markers",
                hovertext=ev_text,
                hoverinfo="text",
                marker={"symbol": "diamond", "size": 9, "color": "#111"},
            )
        )
    order = [label for label, _ in rows]
    if path is not None:
        segs = path.segments
        fig.add_trace(
            go.Bar(
                name="critical path",
                orientation="h",
                y=[PATH_ROW] * len(segs),
                base=[(min(s.start_ns, s.end_ns) - origin) / 1e6 for s in segs],
                x=[abs(s.duration_ns) / 1e6 for s in segs],
                marker={
                    "color": [("#ff0000" if s.negative else SEGMENT_COLORS[s.name]) for s in segs],
                    "pattern": {"shape": ["/" if s.name is Seg.UNKNOWN else "" for s in segs]},
                    "line": {"color": "#222", "width": 1},
                },
                text=[_seg_label(s.name, s.covers) for s in segs],
                textposition="inside",
                insidetextanchor="middle",
                hovertext=[
                    f"<b>{html.escape(_seg_label(s.name, s.covers))}</b><br>"
                    f"{s.duration_ns / 1e6:.3f} ms"
                    + (" (NEGATIVE: out of order)" if s.negative else "")
                    + (f"<br>error: {html.escape(s.error)}" if s.error else "")
                    for s in segs
                ],
                hoverinfo="text",
            )
        )
        order = [PATH_ROW, *order]
        end_label = "TTFT" if path.ttft_ns is not None else "request ended (no first token)"
        fig.add_vline(
            x=path.total_ns / 1e6,
            line_dash="dash",
            line_color="#d62728",
            annotation_text=f"{end_label} {path.total_ns / 1e6:.2f} ms",
        )
        # open on the TTFT window (decode runs far past it); double-click zooms out to all
        total_ms = max(path.total_ns, 1) / 1e6
        fig.update_xaxes(range=[-0.02 * total_ms, 1.15 * total_ms])
    fig.update_layout(
        barmode="overlay",
        height=120 + 26 * len(order),
        # Room for the whole row label ("prefill tp0 · rendezvous_wait"): a fixed narrow
        # margin clipped labels to their last letters.
        margin={"l": label_margin(order), "r": 10, "t": 40, "b": 40},
        xaxis_title="ms since the request reached the router",
        yaxis={
            "categoryorder": "array",
            "categoryarray": order,
            "autorange": "reversed",
            "automargin": True,
        },
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"},
        hoverlabel={"align": "left"},
    )
    return fig


def label_margin(labels: list[str], px_per_char: float = 7.5) -> int:
    """Left margin (px) that fits the longest row label at Plotly's default 12 px font."""
    return int(20 + px_per_char * max((len(label) for label in labels), default=0))


def _seg_label(name: Seg, covers: tuple[Seg, ...]) -> str:
    if name is Seg.UNKNOWN:
        return "unknown: " + " + ".join(c.value for c in covers)
    return name.value
