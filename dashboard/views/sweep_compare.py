"""The comparison view's sweep section: the study's figure for any two or more sweep runs
(``pushkv bench --sweep`` folders), one line per configuration and one dash style per run.

Offers every sweep found under ``runs/`` and any sweep that holds the compared run folders
(a sweep point's traces sit at ``<sweep>/<config>/<point>/``); the chosen ones go into the
link as ``sweeps`` (paths joined by ``;``). The figure is ``dashboard.sweeps.figure``, the
one ``pushkv bench --sweep`` writes as HTML and PNG.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import streamlit as st

from dashboard.sweeps import SWEEP_FILE, figure, find_sweeps, load_sweep, points_frame
from dashboard.views import chart

SEP = ";"


def candidates(labels: Sequence[str], root: str = "runs") -> list[str]:
    """Sweeps holding any of ``labels`` (run folders), then those under ``root``."""
    out: list[str] = []
    for label in labels:
        for parent in [Path(label), *list(Path(label).parents)[:3]]:
            if (parent / SWEEP_FILE).is_file() and str(parent) not in out:
                out.append(str(parent))
    out += [str(p) for p in find_sweeps(root) if str(p) not in out]
    return out


def _label(path: str, chosen: Sequence[str]) -> str:
    """The folder's name, or more of its path where two chosen sweeps share a name."""
    name = Path(path).name
    same = [c for c in chosen if Path(c).name == name]
    return name if len(same) == 1 else path


def render(labels: Sequence[str], params: dict[str, str]) -> None:
    linked = [s for s in st.query_params.get("sweeps", "").split(SEP) if s]
    found = candidates(labels)
    options = list(dict.fromkeys([*linked, *found]))
    if not options:
        return
    st.subheader("Sweeps: TTFT and TPOT against request rate")
    chosen = st.multiselect(
        "Sweep runs (one line per configuration; one dash style per run)",
        options,
        default=linked or found[:2],
        key="sweeps",
    )
    params["sweeps"] = SEP.join(chosen)
    data: dict[str, Any] = {}
    for path in chosen:
        try:
            data[_label(path, chosen)] = load_sweep(path)
        except (OSError, ValueError) as e:
            st.warning(f"{path}: {e}")
    df = points_frame(data)
    if df.empty:
        st.info("No sweep point with numbers in the chosen runs.")
        return
    chart.show(figure(df), key="sweep_figure")
