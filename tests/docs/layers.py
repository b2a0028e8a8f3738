"""What each layer of the tree may import: the rules docs/architecture.md states.

Owns: ``LAYERS`` (the rules, as data), ``imports_of`` (every import of a module, lazy ones
too, read with ``ast``), ``violations`` and ``table`` (the rules as the markdown table that
``python -m tests.docs.render --write`` puts into docs/architecture.md). A module belongs to
the first layer whose path prefix it has.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.docs.commands import ROOT

HEAVY = ("vllm", "nixl", "torch", "triton")


@dataclass(frozen=True)
class Layer:
    name: str  # as the table shows it
    paths: tuple[str, ...]  # path prefixes of its modules, relative to the root
    may: tuple[str, ...]  # pushkv modules (dotted prefixes) it may import
    never: tuple[str, ...]  # third-party or stdlib modules it must not import, lazily or not
    note: str = ""


LAYERS: tuple[Layer, ...] = (
    Layer(
        "`connector/core/`",
        ("connector/core/",),
        ("connector.core",),
        (*HEAVY, "threading", "time"),
        "pure: time is an argument",
    ),
    Layer(
        "`connector/transport/`",
        ("connector/transport/",),
        ("connector.core.errors", "connector.core.auth", "connector.transport"),
        ("vllm", "torch"),
        "NIXL only in `nixl.py`, imported lazily",
    ),
    Layer(
        "`connector/transfer/`",
        ("connector/transfer/",),
        (
            "connector.core",
            "connector.transport",
            "connector.transfer",
            "connector.config",
            "telemetry.schema",
            "telemetry.emit",
            "telemetry.setup",
        ),
        ("vllm", "nixl"),
        "torch and Triton only in `gpu/`",
    ),
    Layer(
        "`connector/router/`",
        ("connector/router/",),
        ("connector.router", "connector.kv_params", "connector.core.errors", "telemetry"),
        HEAVY,
    ),
    Layer(
        "`connector/tools/`",
        ("connector/tools/",),
        ("connector", "telemetry", "dashboard.sweeps"),
        ("nixl",),
        "servers are child processes; `bench/vllm_*.py` are connectors loaded into vLLM; "
        "`bench/plots.py` draws the dashboard's sweep figure",
    ),
    Layer(
        "`connector/cli.py`",
        ("connector/cli.py",),
        ("connector", "telemetry", "dashboard"),
        HEAVY,
        "dispatches each subcommand lazily",
    ),
    Layer(
        "the vLLM adapter: `connector/*.py`",
        ("connector/",),
        (
            "connector.core",
            "connector.transport",
            "connector.transfer",
            "connector.config",
            "connector.kv_params",
            "connector.metadata",
            "connector.kv_tensors",
            "connector.scheduler_side",
            "connector.worker_side",
            "connector.plugin",
            "connector.stats",
            "connector.vllm_compat",
            "telemetry",
        ),
        ("nixl",),
        "vLLM only in `plugin.py`, `vllm_compat.py` (its version differences) and the two "
        "`*_side.py`",
    ),
    Layer("`telemetry/`", ("telemetry/",), ("telemetry",), HEAVY, "`schema.py` imports nothing"),
    Layer("`dashboard/`", ("dashboard/",), ("dashboard", "telemetry"), HEAVY),
)
_PUSHKV = ("connector", "telemetry", "dashboard", "bench")


def layer_of(path: str) -> Layer | None:
    return next((layer for layer in LAYERS if path.startswith(layer.paths)), None)


def imports_of(path: Path) -> Iterator[str]:
    """Every absolute import in the module, at any depth (lazy imports count too)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(root: Path = ROOT) -> list[str]:
    out: list[str] = []
    paths = [
        p for top in ("connector", "telemetry", "dashboard") for p in (root / top).rglob("*.py")
    ]
    for path in sorted(paths):
        rel = path.relative_to(root).as_posix()
        layer = layer_of(rel)
        if layer is None:
            continue
        for module in imports_of(path):
            if module.split(".")[0] in _PUSHKV and not _under(module, layer.may):
                out.append(f"{rel} imports {module} ({layer.name} may import {layer.may})")
            if _under(module, layer.never) and not _allowed(rel, module):
                out.append(f"{rel} imports {module} ({layer.name} must not)")
    return out


def _allowed(rel: str, module: str) -> bool:
    """The exceptions the notes name."""
    top = module.split(".")[0]
    return (
        (rel.startswith("connector/transfer/gpu/") and top in ("torch", "triton"))
        or (
            rel
            in ("connector/plugin.py", "connector/vllm_compat.py", "connector/scheduler_side.py")
            and top == "vllm"
        )
        or (rel == "connector/worker_side.py" and top in ("vllm", "torch"))
    )


def table() -> str:
    rows = ["| layer | may import, of pushkv | must not import | note |", "|---|---|---|---|"]
    for layer in LAYERS:
        may = ", ".join(f"`{m}`" for m in layer.may)
        never = ", ".join(layer.never)
        rows.append(f"| {layer.name} | {may} | {never} | {layer.note} |")
    return "\n".join(rows) + "\n"
