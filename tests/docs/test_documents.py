"""The repository's documents: every command in them is tagged and checked, every link
resolves, the generated tables match the code, and the front door stays short.

What each check tag means is in tests/docs/commands.py. ``e2e`` groups run in
tests/e2e/test_documented_commands.py (real vLLM); everything else runs here, fast.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.docs import layers, render
from tests.docs.argv import check_command
from tests.docs.commands import (
    PORT_VARS,
    ROOT,
    Block,
    DocError,
    all_blocks,
    anchors,
    check_tagged,
    commands,
    documents,
    group,
    inline_commands,
    knob_tables,
    links,
)

DOCS = documents()
BLOCKS = all_blocks(DOCS)
# The groups tests/e2e/test_documented_commands.py runs.
E2E_GROUPS = frozenset({"pd-stack"})
README_MAX_LINES = 250
# Documents outside the repository that older prose pointed at.
FORBIDDEN = (re.compile(r"shared/(reference|design|style)"), re.compile(r"design\.md"))


def _id(block: Block) -> str:
    return block.where


def _of_kind(kind: str) -> list[Block]:
    return [b for b in BLOCKS if b.check is not None and b.check.kind == kind]


def test_the_documents_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    for required in (
        "README.md",
        "docs/architecture.md",
        "docs/protocol.md",
        "docs/operations.md",
        "docs/benchmarks.md",
        "bench/README.md",
        "connector/README.md",
        "connector/core/README.md",
    ):
        assert required in names


@pytest.mark.parametrize("block", BLOCKS, ids=_id)
def test_every_block_is_tagged(block: Block) -> None:
    check_tagged(block)


@pytest.mark.parametrize("block", _of_kind("argv"), ids=_id)
def test_argv_blocks_parse(block: Block) -> None:
    problems = [p for argv in commands(block.text) if (p := check_command(argv)) is not None]
    assert not problems, f"{block.where}:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_inline_commands_parse(doc: Path) -> None:
    problems = []
    for span in inline_commands(doc.read_text()):
        for argv in commands(span):
            if (p := check_command(argv)) is not None:
                problems.append(f"`{span}`: {p}")
    assert not problems, f"{doc.relative_to(ROOT)}:\n" + "\n".join(problems)


def _venv_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.parametrize("block", _of_kind("run"), ids=_id)
def test_run_blocks_run(block: Block, tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.text],
        cwd=tmp_path,
        env=_venv_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{block.where}: exit {done.returncode}\n{done.stderr[-2000:]}"


@pytest.mark.parametrize("block", _of_kind("covered"), ids=_id)
def test_covered_blocks_name_existing_tests(block: Block) -> None:
    assert block.check is not None
    for target in block.check.words:
        path, _, test = target.partition("::")
        assert (ROOT / path).is_file(), f"{block.where}: {path} does not exist"
        if test:
            tree = ast.parse((ROOT / path).read_text())
            names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert test in names, f"{block.where}: no test {test} in {path}"


@pytest.mark.parametrize("block", _of_kind("manual"), ids=_id)
def test_manual_blocks_say_why(block: Block) -> None:
    assert block.check is not None and len(block.check.words) >= 3, (
        f"{block.where}: say in a few words why this cannot run on the CI machine"
    )


def test_e2e_groups_are_known_and_the_pd_block_defines_its_ports() -> None:
    groups = {b.check.arg for b in _of_kind("e2e") if b.check is not None}
    assert groups == E2E_GROUPS, f"groups {groups}; the e2e test runs {sorted(E2E_GROUPS)}"
    first = group(BLOCKS, "pd-stack")[0]
    for name in PORT_VARS:
        assert len(re.findall(rf"^{name}=\d+$", first.text, flags=re.M)) == 1, (
            f"{first.where}: the block must set {name}=<port> once, on a line of its own"
        )


def test_the_pd_block_passes_what_vllm_needs_on_a_cpu_host() -> None:
    # vLLM's CPU backend reserves 92 % of the host's memory per server unless the KV cache
    # is sized (the second server then fails), and spans are lost without a shutdown timeout.
    text = "".join(b.text for b in group(BLOCKS, "pd-stack"))
    for flag in ("--kv-cache-memory-bytes", "--shutdown-timeout"):
        assert flag in text


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve(doc: Path) -> None:
    problems = []
    for target in links(doc.read_text()):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            problems.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not problems, f"{doc.relative_to(ROOT)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_references_to_documents_outside_the_repository(doc: Path) -> None:
    text = doc.read_text()
    found = [p.pattern for p in FORBIDDEN if p.search(text)]
    assert not found, f"{doc.relative_to(ROOT)} points outside the repository: {found}"


def test_the_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES
    # Dated logs belong in bench/results/ and commit messages, not on the front page.
    dated = [ln for ln in lines if re.search(r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d-\d\d:\d\d\b", ln)]
    assert not dated, dated


@pytest.mark.parametrize("doc", sorted(render.sections()), ids=lambda p: p.name)
def test_generated_tables_match_the_code(doc: Path) -> None:
    text, rendered = doc.read_text(), render.sections()[doc]
    assert set(render.section_names(text)) == set(rendered)
    assert render.apply(text, rendered) == text, (
        f"{doc.relative_to(ROOT)}'s generated tables differ from the code: "
        "run `python -m tests.docs.render --write`"
    )


def test_every_module_keeps_its_layers_import_rules() -> None:
    found = layers.violations()
    assert not found, "\n".join(found)


def test_the_import_graph_has_no_cycle() -> None:
    found = layers.cycles()
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_layer_rules_catch_the_arrows_that_point_up(tmp_path: Path) -> None:
    """config.py below transfer/, scheduler_side.py away from it, test-only code out of the
    product but for worker_side's lazy ``_faults`` hook."""
    root = _tree(
        tmp_path,
        {
            "connector/config.py": "from connector.transfer.polling import Backoff\n",
            "connector/scheduler_side.py": "from connector.transfer.spans import NO_SPANS\n",
            "connector/plugin.py": "def f():\n    import pushkv_testing.faults\n",
            "connector/worker_side.py": "def f():\n    import pushkv_testing.faults\n",
            "connector/stats.py": "import bench.soak\n",
        },
    )
    found = layers.violations(root)
    for rel in ("config.py", "scheduler_side.py", "plugin.py", "stats.py"):
        assert any(v.startswith(f"connector/{rel} imports") for v in found), (rel, found)
    assert not any(v.startswith("connector/worker_side.py") for v in found), found


def test_cycles_count_lazy_imports_and_not_type_checking_ones(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "bench/a.py": "def f():\n    from bench.b import x\n",
            "bench/b.py": "import bench.a\n",
            "bench/c.py": "import typing\nif typing.TYPE_CHECKING:\n    import bench.d\n",
            "bench/d.py": "from bench import c\n",
        },
    )
    assert layers.cycles(root) == [["bench.a", "bench.b"]]


def _defaults(target: str) -> dict[str, Any]:
    module, _, name = target.partition(":")
    obj = getattr(importlib.import_module(module), name)
    if isinstance(obj, type) and issubclass(obj, msgspec.Struct):
        return {f.encode_name: f.default for f in msgspec.structs.fields(obj)}
    parser = obj()  # an argparse parser factory
    out: dict[str, Any] = {}
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            out[action.option_strings[0]] = "required" if action.required else action.default
    return out


def _same(stated: str, actual: Any) -> bool:
    if actual is None:
        return stated == "-"
    if isinstance(actual, str):
        return stated == actual
    try:
        return json.loads(stated) == (list(actual) if isinstance(actual, tuple) else actual)
    except json.JSONDecodeError:
        return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_knob_tables_match_the_code(doc: Path) -> None:
    for table in knob_tables(doc.read_text()):
        actual = _defaults(table.target)
        assert set(table.rows) == set(actual), f"{table.target}: names differ"
        wrong = {k: (v, actual[k]) for k, v in table.rows.items() if not _same(v, actual[k])}
        assert not wrong, f"{table.target}: stated vs actual defaults {wrong}"


# Each README gives a reading order of its package: a module it does not name is missing.
PACKAGE_READMES = {
    "connector": "connector/README.md",
    "connector/core": "connector/core/README.md",
    "connector/transfer": "connector/transfer/README.md",
    "connector/transfer/gpu": "connector/transfer/gpu/README.md",
    "connector/transport": "connector/transport/README.md",
    "connector/router": "connector/router/README.md",
    "connector/tools": "connector/tools/README.md",
    "telemetry": "telemetry/README.md",
    "dashboard": "dashboard/README.md",
    "bench": "bench/README.md",
}


def _modules(package: str) -> list[Path]:
    """The package's modules, and those of sub-packages without a README of their own."""
    here = ROOT / package
    mods = [p for p in here.glob("*.py") if p.name != "__init__.py"]
    for sub in sorted(p for p in here.iterdir() if (p / "__init__.py").is_file()):
        if sub.relative_to(ROOT).as_posix() not in PACKAGE_READMES:
            mods += [p for p in sub.rglob("*.py") if p.name != "__init__.py"]
    return sorted(mods)


@pytest.mark.parametrize("package", sorted(PACKAGE_READMES))
def test_package_readmes_name_every_module(package: str) -> None:
    text = (ROOT / PACKAGE_READMES[package]).read_text()
    missing = [
        p.relative_to(ROOT).as_posix()
        for p in _modules(package)
        if not re.search(rf"(?<![\w.]){re.escape(p.stem)}(\.py)?\b", text)
    ]
    assert not missing, f"{PACKAGE_READMES[package]} does not name {missing}"


def _round_medians() -> dict[tuple[str, int], dict[str, float]]:
    """Medians over the six round reports the README's results table is taken from."""
    columns = {"ttft": 3, "tpot": 5, "rps": 8}
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    folder = ROOT / "bench/results/cpu_rounds_20261202"
    for report in sorted(folder.glob("set-[fh]/round-*.md")):
        results = report.read_text().split("## Results", 1)[1].split("\n\n", 1)[0]
        for line in results.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) > 8 and cells[1].isdigit():
                values = {k: float(cells[i]) for k, i in columns.items()}
                rows.setdefault((cells[0], int(cells[1])), []).append(values)
    assert all(len(v) == 6 for v in rows.values()), {k: len(v) for k, v in rows.items()}
    return {k: {c: statistics.median(r[c] for r in v) for c in columns} for k, v in rows.items()}


def test_the_readme_results_are_the_medians_of_the_round_reports() -> None:
    text = (ROOT / "README.md").read_text()
    configs = {
        "**pushkv**": "push",
        "vLLM NixlPushConnector, progress thread off": "vllm-push-noprog",
        "vLLM NixlConnector, progress thread off": "vllm-pull-noprog",
    }
    medians = _round_medians()
    seen = 0
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] not in configs:
            continue
        config = configs[cells[0]]
        stated = [float(re.sub(r"[^\d.]", "", c)) for c in cells[1:]]
        actual = [
            medians[config, 4]["ttft"],
            medians[config, 4]["tpot"],
            medians[config, 16]["ttft"],
            medians[config, 16]["tpot"],
            medians[config, 16]["rps"],
        ]
        for s, a, cell in zip(stated, actual, cells[1:], strict=True):
            decimals = len(cell.split(".")[1].rstrip(" ms*")) if "." in cell else 0
            assert abs(s - a) <= 0.5 * 10**-decimals + 1e-9, f"{config}: {cell} but {a}"
        seen += 1
    assert seen == len(configs)


def test_doc_errors_name_the_place() -> None:
    with pytest.raises(DocError, match="README.md:1"):
        check_tagged(Block(ROOT / "README.md", 1, "bash", "ls\n", None))
