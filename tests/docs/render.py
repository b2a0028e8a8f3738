"""The documents' tables that are rendered from the code: the transition tables of
connector/core/send_state.py, recv_state.py and lifecycle.py (docs/protocol.md) and the
import rules of tests/docs/layers.py (docs/architecture.md).

Run: python -m tests.docs.render [--write]
Prints each generated section, or with ``--write`` replaces the text between its markers
(``<!-- generated: NAME -->`` ... ``<!-- end generated -->``) in the documents.
tests/docs/test_documents.py fails while a document differs from what this renders, so the
tables cannot drift from the code. Imports only the pure core.
"""

from __future__ import annotations

import argparse
import enum
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from connector.core import state
from connector.core.transition import LOCAL_EVENTS
from tests.docs import layers
from tests.docs.commands import ROOT

PROTOCOL = ROOT / "docs" / "protocol.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
_SECTION = re.compile(
    r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S
)


def _cell(fn: Callable[..., Any]) -> str:
    name = fn.__name__.lstrip("_")
    for prefix in ("s_", "r_"):
        name = name.removeprefix(prefix)
    return f"`{name}`"


def _events(pairs: Iterable[tuple[Any, type]]) -> list[type]:
    seen: dict[type, None] = {}
    for _, event in pairs:
        seen.setdefault(event, None)
    return list(seen)


def table(
    states: Iterable[enum.Enum],
    transitions: Mapping[tuple[Any, type], Callable[..., Any]],
    new: Mapping[type, Callable[..., Any]] | None = None,
) -> str:
    """One row per state (and one for an unknown transfer id when ``new`` is given), one
    column per event type. A cell names the transition; a pair missing from the table
    raises: ``drop`` (RemoteProtocolError: dropped and counted) or ``bug``
    (LocalProtocolError: one of our own events out of turn)."""
    events = _events(transitions)
    events += [e for e in (new or {}) if e not in events]
    local = set(LOCAL_EVENTS)

    def missing(event: type) -> str:
        return "bug" if event in local else "drop"

    head = [e.__name__ for e in events]
    rows = ["| state | " + " | ".join(head) + " |", "|---" * (len(events) + 1) + "|"]
    if new is not None:
        cells = [_cell(new[e]) if e in new else missing(e) for e in events]
        rows.append("| (unknown id) | " + " | ".join(cells) + " |")
    for s in states:
        cells = [_cell(transitions[s, e]) if (s, e) in transitions else missing(e) for e in events]
        rows.append(f"| {s.name} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def lifecycle_table() -> str:
    """The scheduler role's request table (connector/core/lifecycle.py), one row per entry."""
    from connector.core import lifecycle

    rows = ["| state | event | next state | effect |", "|---|---|---|---|"]
    for st, event, to, effect in lifecycle.rows():
        rows.append(f"| {st} | {event} | {to} | {'-' if effect == 'none' else f'`{effect}`'} |")
    return "\n".join(rows) + "\n"


def sections() -> dict[Path, dict[str, str]]:
    """Every generated section, by document and name."""
    return {
        PROTOCOL: {
            "send-table": table(state.SendState, state.SEND_TABLE, state.SEND_NEW),
            "recv-table": table(state.RecvState, state.RECV_TABLE),
            "lifecycle-table": lifecycle_table(),
        },
        ARCHITECTURE: {"import-rules": layers.table()},
    }


def apply(text: str, rendered: Mapping[str, str]) -> str:
    """``text`` with every generated section replaced by its rendering."""

    def sub(m: re.Match[str]) -> str:
        if m["name"] not in rendered:
            raise KeyError(f"no renderer for the section {m['name']!r}")
        return m[1] + rendered[m["name"]] + m[4]

    return _SECTION.sub(sub, text)


def section_names(text: str) -> list[str]:
    return [m["name"] for m in _SECTION.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.docs.render", description=__doc__)
    ap.add_argument("--write", action="store_true", help="update the documents")
    args = ap.parse_args(argv)
    for path, rendered in sections().items():
        if args.write:
            path.write_text(apply(path.read_text(), rendered))
            continue
        for name, body in rendered.items():
            print(f"<!-- {path.relative_to(ROOT)} -->")
            print(f"<!-- generated: {name} -->\n{body}<!-- end generated -->\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
