"""What each layer of the tree may import: the rules docs/architecture.md states.

Owns: ``LAYERS`` (the rules, as data), ``imports_of`` (every import of a module, lazy ones
too, read with ``ast``), ``violations`` and ``table`` (the rules as the markdown table that
``python -m tests.docs.render --write`` puts into docs/architecture.md), and ``cycles`` (the
import graph's cycles, lazy imports included, ``TYPE_CHECKING`` ones not: those never run).
A module belongs to the first layer whose path prefix it has.
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


_SCHEDULER_MAY = (
    "connector.core",
    "connector.config",
    "connector.kv_params",
    "connector.metadata",
    "connector.kv_tensors",
    "connector.model_support",
    "connector.engine_spans",
    "connector.shutdown",
    "connector.scheduler_side",
    "connector.leg_intake",
    "connector.first_token",
    "connector.block_tracker",
    "connector.plugin",
    "connector.stats",
    "connector.vllm_compat",
    "telemetry",
)

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
        (
            "connector.core.errors",
            "connector.core.auth",
            "connector.transport",
            "telemetry.schema",
            "telemetry.counts",
        ),
        ("vllm", "torch"),
        "NIXL called only in `nixl.py`, imported lazily (`nixl_api.py`)",
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
            "telemetry.counts",
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
        "`connector/config.py`",
        ("connector/config.py",),
        ("connector.core",),
        HEAVY,
        "below `transfer/`, which reads it",
    ),
    Layer(
        "the scheduler role: `connector/scheduler_side.py`, `leg_intake.py`, `first_token.py`, "
        "`block_tracker.py`",
        (
            "connector/scheduler_side.py",
            "connector/leg_intake.py",
            "connector/first_token.py",
            "connector/block_tracker.py",
        ),
        _SCHEDULER_MAY,
        ("nixl", "torch", "triton"),
        "runs in EngineCore, where no transfer thread is: nothing of `transfer/`",
    ),
    Layer(
        "the vLLM adapter: `connector/*.py`",
        ("connector/",),
        (*_SCHEDULER_MAY, "connector.transport", "connector.transfer", "connector.worker_side"),
        ("nixl",),
        "vLLM only in `plugin.py`, `vllm_compat.py` (its version differences) and the two "
        "`*_side.py`; `pushkv_testing.faults` only lazily in `worker_side.py`, for `_faults`",
    ),
    Layer("`telemetry/`", ("telemetry/",), ("telemetry",), HEAVY, "`schema.py` imports nothing"),
    Layer("`dashboard/`", ("dashboard/",), ("dashboard", "telemetry"), HEAVY),
    Layer(
        "`pushkv_testing/`",
        ("pushkv_testing/",),
        ("connector", "telemetry", "pushkv_testing"),
        ("vllm", "nixl"),
        "test-only harness, not in the wheel",
    ),
)
_PUSHKV = ("connector", "telemetry", "dashboard", "bench", "pushkv_testing")
_CHECKED = ("connector", "telemetry", "dashboard", "pushkv_testing")
# The one arrow from the product into test-only code: a real engine under ``_faults``.
_TEST_HOOK = ("connector/worker_side.py", "pushkv_testing.faults")


def layer_of(path: str) -> Layer | None:
    return next((layer for layer in LAYERS if path.startswith(layer.paths)), None)


def imports_of(path: Path) -> Iterator[str]:
    """Every absolute import in the module, at any depth (lazy imports count too)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk`` without the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if _is_type_checking(child):
            assert isinstance(child, ast.If)
            for other in child.orelse:
                yield other
                yield from _runtime_nodes(other)
            continue
        yield child
        yield from _runtime_nodes(child)


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the tree it imports when it runs (``from a import b`` where
    ``a.b`` is a module counts as importing ``a.b``)."""
    files = {
        _module_name(p, root): p for top in (*_CHECKED, "bench") for p in (root / top).rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    if sub in files:
                        edges.add(sub)
                    elif node.module in files:
                        edges.add(node.module)
        graph[name] = edges - {name}
    return graph


def cycles(root: Path = ROOT) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(root: Path = ROOT) -> list[str]:
    out: list[str] = []
    paths = [p for top in _CHECKED for p in (root / top).rglob("*.py")]
    for path in sorted(paths):
        rel = path.relative_to(root).as_posix()
        layer = layer_of(rel)
        if layer is None:
            continue
        for module in imports_of(path):
            if (rel, module) == _TEST_HOOK and module not in _top_level_imports(path):
                continue
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
