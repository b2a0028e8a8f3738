"""The source picker: a run folder or a Jaeger URL (with service, window and cap)."""

from __future__ import annotations

import os
from typing import Any

from dashboard.state import DEFAULT_RUN_DIR, ENV_JAEGER_URL, JAEGER, RUN, Source, known_runs

DEFAULT_JAEGER_URL = "http://127.0.0.1:16686"


def source_picker(box: Any, prefix: str, default: Source) -> Source:
    """Widgets in ``box`` (the sidebar, a column); keys start with ``prefix``."""
    kinds = [RUN, JAEGER]
    kind = box.radio(
        "Source", kinds, index=kinds.index(default.kind), key=f"{prefix}kind", horizontal=True
    )
    if kind == RUN:
        current = default.location if default.kind == RUN else DEFAULT_RUN_DIR
        folder = box.selectbox(
            "Run folder",
            known_runs(current),
            index=0,
            key=f"{prefix}run",
            accept_new_options=True,
            help="A folder with traces-*.jsonl files (one per process)",
        )
        return Source(RUN, str(folder))
    url = box.text_input(
        "Jaeger URL",
        default.location
        if default.kind == JAEGER
        else os.environ.get(ENV_JAEGER_URL, DEFAULT_JAEGER_URL),
        key=f"{prefix}jaeger",
    )
    service = box.text_input("Service", default.service, key=f"{prefix}service")
    lookback = box.number_input(
        "Look back (minutes)",
        1,
        10 * 366 * 24 * 60,
        int(default.lookback_min),
        key=f"{prefix}lookback",
    )
    limit = box.number_input("At most (traces)", 1, 50_000, default.limit, key=f"{prefix}limit")
    return Source(JAEGER, url.strip(), service.strip(), float(lookback), int(limit))


def source_params(source: Source, prefix: str = "") -> dict[str, str]:
    """Query parameters that bring the same source back."""
    if source.kind == JAEGER:
        return {
            f"{prefix}jaeger": source.location,
            "service": source.service,
            "lookback": f"{source.lookback_min:g}",
        }
    return {f"{prefix}run": source.location}
