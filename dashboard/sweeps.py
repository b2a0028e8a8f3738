"""Sweep runs (``pushkv bench --sweep``) and the study's figures of them. Pure (no Streamlit).

Owns: finding sweep folders (those holding ``sweep.json``) and reading them, the long frame of
their points, and the figure: one column of panels per input length, x = request rate, rows
TTFT p50, TTFT p90 and mean TPOT, one line per configuration (and, for several runs, one dash
style per run). ``pushkv bench --sweep`` writes this figure as HTML and PNG
(``connector/tools/bench/plots.py``); the comparison view draws it for any two or more runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

SWEEP_FILE = "sweep.json"  # = connector.tools.bench.sweep_points.SWEEP_FILE
ROWS: tuple[tuple[str, str], ...] = (
    ("median_ttft_ms", "TTFT p50 (ms)"),
    ("p90_ttft_ms", "TTFT p90 (ms)"),
    ("mean_tpot_ms", "mean TPOT (ms)"),
)
# The same colour for a configuration in every figure; the ideal in black.
COLOURS = {
    "single": "#222222",
    "push": "#1f77b4",
    "push-notrace": "#17becf",
    "vllm-push-noprog": "#ff7f0e",
    "vllm-pull-noprog": "#d62728",
    "vllm-push": "#bcbd22",
    "vllm-pull": "#9467bd",
}
OTHER_COLOURS = ("#2ca02c", "#8c564b", "#e377c2", "#7f7f7f")
DASHES = ("solid", "dash", "dot", "dashdot", "longdash")


def find_sweeps(root: str | os.PathLike[str], max_depth: int = 3) -> list[Path]:
    """Folders under ``root`` (itself included) holding a ``sweep.json``, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        if len(Path(dirpath).relative_to(root).parts) >= max_depth:
            dirnames[:] = []
        if SWEEP_FILE in filenames:
            found.append(Path(dirpath))
            dirnames[:] = []  # a sweep's own sub-folders are its configurations
    return sorted(found, key=lambda p: (p / SWEEP_FILE).stat().st_mtime_ns, reverse=True)


def load_sweep(folder: str | os.PathLike[str]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((Path(folder) / SWEEP_FILE).read_text())
    return data


def points_frame(sweeps: Mapping[str, Mapping[str, Any]]) -> pd.DataFrame:
    """One row per point with numbers: run (the mapping's key), config, input_len, rate,
    ok, completed, num_prompts and every metric."""
    rows = [
        {
            "run": label,
            "config": p["config"],
            "input_len": int(p["input_len"]),
            "rate": float(p["rate"]),
            "ok": bool(p["ok"]),
            "completed": p.get("completed", 0),
            "num_prompts": p.get("num_prompts", 0),
            **p.get("metrics", {}),
        }
        for label, data in sweeps.items()
        for p in _in_run_order(data)
        if p.get("metrics")
    ]
    if not rows:
        columns = ["run", "config", "input_len", "rate", "ok", "completed", "num_prompts"]
        return pd.DataFrame(columns=columns + [k for k, _ in ROWS])
    return pd.DataFrame(rows)


def _in_run_order(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The sweep's points, its configurations in the order it ran them (the legend's)."""
    order = {c: i for i, c in enumerate(data.get("configs", []))}
    points: list[dict[str, Any]] = data.get("points", [])
    return sorted(points, key=lambda p: order.get(p["config"], len(order)))


def colour(config: str, configs: list[str]) -> str:
    if config in COLOURS:
        return COLOURS[config]
    unknown = [c for c in configs if c not in COLOURS]
    return OTHER_COLOURS[unknown.index(config) % len(OTHER_COLOURS)]


def figure(df: pd.DataFrame, title: str = "") -> go.Figure:
    """The study's figure of ``points_frame``'s rows."""
    lengths = sorted(df["input_len"].unique()) if not df.empty else []
    fig = make_subplots(
        rows=len(ROWS),
        cols=max(1, len(lengths)),
        shared_xaxes=True,
        column_titles=[f"{n} tokens in" for n in lengths] or None,
        vertical_spacing=0.06,
        horizontal_spacing=0.05,
    )
    runs = list(dict.fromkeys(df["run"])) if not df.empty else []
    configs = list(dict.fromkeys(df["config"])) if not df.empty else []
    for run_i, run in enumerate(runs):
        for config in configs:
            name = config if len(runs) == 1 else f"{config} ({run})"
            shown = False
            for col, n in enumerate(lengths, start=1):
                sel = df[(df["run"] == run) & (df["config"] == config) & (df["input_len"] == n)]
                sel = sel.sort_values("rate")
                if sel.empty:
                    continue
                for row, (key, _) in enumerate(ROWS, start=1):
                    if key not in sel:
                        continue
                    fig.add_trace(
                        go.Scatter(
                            x=sel["rate"],
                            y=sel[key],
                            mode="lines+markers",
                            name=name,
                            legendgroup=name,
                            showlegend=not shown,
                            line={
                                "color": colour(config, configs),
                                "dash": DASHES[run_i % len(DASHES)],
                            },
                            # an open marker: not every request of the point completed
                            marker={"symbol": ["circle" if ok else "x" for ok in sel["ok"]]},
                            customdata=sel[["completed", "num_prompts"]].to_numpy(),
                            hovertemplate=f"{name}<br>%{{x}} req/s: %{{y:.1f}} ms"
                            "<br>%{customdata[0]}/%{customdata[1]} completed<extra></extra>",
                        ),
                        row=row,
                        col=col,
                    )
                    shown = True
    fig.update_yaxes(rangemode="tozero")
    rates = sorted(df["rate"].unique()) if not df.empty else []
    fig.update_xaxes(tickvals=rates)  # the offered rates themselves, e.g. 1 2 4 8
    for row, (_, label) in enumerate(ROWS, start=1):
        fig.update_yaxes(title_text=label, row=row, col=1)
    for col in range(1, len(lengths) + 1):
        fig.update_xaxes(title_text="request rate (req/s)", row=len(ROWS), col=col)
    fig.update_layout(
        title=title or None,
        template="plotly_white",
        height=300 * len(ROWS) + 80,
        legend={"orientation": "h", "y": -0.08},
        margin={"t": 80 if title else 50},
    )
    return fig
