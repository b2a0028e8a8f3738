"""The sweep's figures as files: ``sweep.html`` (interactive, self-contained) and ``sweep.png``.

The figure itself is ``dashboard.sweeps.figure`` (the comparison view draws the same one);
this module only writes it. HTML needs plotly (the ``dashboard`` extra); PNG also needs
kaleido, which drives a local Chromium (Debian's ``/usr/bin/chromium``): without either, the
sweep still has its numbers and says what it did not write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HTML, PNG = "sweep.html", "sweep.png"


def write_figures(run_dir: Path, data: dict[str, Any], png: bool = True) -> list[str]:
    """Write the figure of ``data`` (a ``sweep.json``) into ``run_dir``, as PNG too with
    ``png``; one line per file written or skipped, for the log."""
    try:
        from dashboard.sweeps import figure, points_frame
    except ImportError as exc:  # plotly or pandas missing: the dashboard extra
        return [f"figures skipped: {exc} (pip install 'pushkv[dashboard]')"]
    df = points_frame({run_dir.name: data})
    if df.empty:
        return ["figures skipped: no point has numbers yet"]
    plan = data.get("plan", {})
    title = (
        f"{run_dir.name}: {Path(str(data.get('model', ''))).name}, "
        f"{plan.get('output_len', '?')} output tokens, Poisson arrivals"
    )
    fig = figure(df, title)
    fig.write_html(run_dir / HTML, include_plotlyjs=True)
    lines = [f"figure {run_dir / HTML}"]
    if not png:
        return lines
    width = 360 * max(1, df["input_len"].nunique()) + 160
    try:
        fig.write_image(run_dir / PNG, width=width, height=fig.layout.height, scale=1.5)
        lines.append(f"figure {run_dir / PNG}")
    except Exception as exc:  # kaleido absent or no browser: the HTML is there
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        lines.append(f"PNG skipped: {why}")
    return lines
