"""The commands the documents show, extracted so that tests can run or check them.

Owns: finding the documents (the README, docs/ and every package README), their fenced code
blocks with the check tag before each one, the commands inside a block and in inline code,
and turning a block group into the script a test runs (with free ports substituted).

A shell block (```bash, ```sh, ```shell, ```console) must have a tag on the line above it:

    <!-- check: argv -->                  every command parsed by its real CLI, not run
    <!-- check: run -->                   run verbatim (fast commands only)
    <!-- check: e2e pd-stack -->          run by tests/e2e/test_documented_commands.py; blocks
                                          of one group run in document order as one script
    <!-- check: covered TARGET... -->     run by another test or by CI (a path, or path::test)
    <!-- check: manual REASON -->         cannot run on the CI machine (e.g. a CUDA install)

Every other fence names its language (``text``, ``mermaid``, ``python``...), so a command
cannot hide in an untagged block. Pure: reads files, runs nothing.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})
KINDS = frozenset({"argv", "run", "e2e", "covered", "manual"})
# The README's P/D block defines these on lines of their own; tests replace the numbers.
PORT_VARS = ("P_PORT", "D_PORT", "ROUTER_PORT")

_TAG = re.compile(r"^\s*<!--\s*check:\s*(?P<kind>[\w-]+)\s*(?P<arg>.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<lang>[^`\s]*)")
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_INLINE_START = ("pushkv ", "python -m ", "make ")
_SEPARATORS = frozenset({"&&", "||", ";", "|", "&"})
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


class DocError(ValueError):
    """A document breaks the rules above (an untagged shell block, an unknown kind...)."""


@dataclass(frozen=True)
class Check:
    kind: str
    arg: str = ""

    @property
    def words(self) -> list[str]:
        return self.arg.split()


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its text and its check tag."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    check: Check | None

    @property
    def where(self) -> str:
        try:
            name = self.path.relative_to(ROOT)
        except ValueError:
            name = self.path
        return f"{name}:{self.line}"


def documents(root: Path = ROOT) -> list[Path]:
    """The README, docs/*.md and every package's README.md (not bench/results' reports)."""
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    for package in ("connector", "telemetry", "dashboard", "bench"):
        docs += sorted(
            p
            for p in (root / package).rglob("README.md")
            if "results" not in p.relative_to(root).parts
        )
    return [p for p in docs if p.is_file()]


def parse_tag(line: str) -> Check | None:
    m = _TAG.match(line)
    if m is None:
        return None
    kind = m["kind"]
    if kind not in KINDS:
        raise DocError(f"unknown check kind {kind!r} (known: {sorted(KINDS)})")
    return Check(kind, m["arg"])


def blocks(text: str, path: Path = ROOT / "<text>") -> list[Block]:
    """Every fenced block of a markdown text, with the tag on the line above it (if any)."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        tag = parse_tag(lines[i - 1]) if i > 0 else None
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
            j += 1
        if j == len(lines):
            raise DocError(f"{path}:{i + 1}: fence never closed")
        out.append(Block(path, i + 1, m["lang"].lower(), "\n".join(body) + "\n", tag))
        i = j + 1
    return out


def check_tagged(block: Block) -> None:
    """Raise DocError unless the block follows the rules of the module docstring."""
    if not block.lang:
        raise DocError(f"{block.where}: a fence without a language (use text, bash, ...)")
    if block.lang in SHELL_LANGS and block.check is None:
        raise DocError(f"{block.where}: a shell block without a <!-- check: ... --> tag")
    if block.check is None:
        return
    if block.lang not in SHELL_LANGS:
        raise DocError(f"{block.where}: a check tag on a {block.lang!r} block")
    kind, words = block.check.kind, block.check.words
    if kind in ("e2e", "covered", "manual") and not words:
        raise DocError(f"{block.where}: `check: {kind}` needs an argument")
    if kind in ("argv", "run") and words:
        raise DocError(f"{block.where}: `check: {kind}` takes no argument")


def prose_lines(text: str) -> Iterator[str]:
    """A document's lines outside fenced blocks. A fence closes only on a line that starts
    with its own opening marker, so a shorter or other fence inside it is content."""
    in_fence = None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if m is not None:
            if in_fence is None:
                in_fence = m["fence"]
            elif line.strip().startswith(in_fence):
                in_fence = None
            continue
        if in_fence is None:
            yield line


def inline_commands(text: str) -> list[str]:
    """Inline code outside fences that is a whole command (``pushkv ...``, ``python -m ...``,
    ``make ...``). Synopses with placeholders (``<``, ``[``, ``...``, ``|``) are skipped."""
    out: list[str] = []
    for line in prose_lines(text):
        for span in _INLINE.findall(line):
            span = span.strip()
            if span.startswith(_INLINE_START) or span == "pushkv":
                if not any(s in span for s in ("<", "[", "...", "|", "{")):
                    out.append(span)
    return out


def logical_lines(script: str) -> list[str]:
    """Lines with backslash continuations joined and blank/comment-only lines dropped."""
    out: list[str] = []
    current = ""
    for raw in script.splitlines():
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1] + " "
            continue
        current += raw
        if current.strip() and not current.strip().startswith("#"):
            out.append(current.strip())
        current = ""
    if current.strip():
        out.append(current.strip())
    return out


def commands(script: str) -> list[list[str]]:
    """The simple commands of a script, as argv lists: comments dropped, split at ``&&``,
    ``;``, ``|``, ``&``, leading ``VAR=value`` assignments removed (a line of assignments only
    gives nothing)."""
    out: list[list[str]] = []
    for line in logical_lines(script):
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        current: list[str] = []
        for token in [*lexer, ";"]:
            if token in _SEPARATORS:
                while current and _ASSIGNMENT.match(current[0]):
                    current.pop(0)
                if current:
                    out.append(current)
                current = []
            else:
                current.append(token)
    return out


def group(all_blocks: list[Block], name: str) -> list[Block]:
    """The blocks tagged ``e2e <name>``, in document order."""
    return [b for b in all_blocks if b.check and b.check.kind == "e2e" and b.check.words == [name]]


def with_ports(script: str, ports: dict[str, int]) -> str:
    """The script with the numbers of its ``NAME=<port>`` assignments replaced. Raises
    DocError unless each name in ``ports`` is assigned exactly once."""
    for name, port in ports.items():
        pattern = re.compile(rf"(?<![\w$]){name}=\d+\b")
        script, n = pattern.subn(f"{name}={port}", script)
        if n != 1:
            raise DocError(f"{name}=<port> must be assigned exactly once, found {n}")
    return script


def all_blocks(paths: list[Path] | None = None) -> list[Block]:
    return [b for p in paths or documents() for b in blocks(p.read_text(), p)]


_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_KNOBS = re.compile(r"^<!--\s*knobs:\s*(?P<target>[\w.]+:\w+)\s*-->\s*$")


def links(text: str) -> list[str]:
    """The targets of markdown links outside fenced blocks (``[text](target)``)."""
    return [target for line in prose_lines(text) for target in _LINK.findall(line)]


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a document's headings (lower case, punctuation dropped, spaces
    to hyphens)."""
    out: set[str] = set()
    for line in prose_lines(text):
        h = _HEADING.match(line)
        if h is not None:
            title = re.sub(r"[`*_]", "", h[1]).lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@dataclass(frozen=True)
class KnobTable:
    """A markdown table under ``<!-- knobs: module:name -->``: first cell a knob's name,
    second its default, as the document states them."""

    target: str
    rows: dict[str, str]


def knob_tables(text: str) -> list[KnobTable]:
    lines = text.splitlines()
    out: list[KnobTable] = []
    for i, line in enumerate(lines):
        m = _KNOBS.match(line)
        if m is None:
            continue
        rows: dict[str, str] = {}
        for row in lines[i + 3 :]:  # skip the header and its separator
            if not row.startswith("|"):
                break
            cells = [c.strip().strip("`") for c in row.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1]
        out.append(KnobTable(m["target"], rows))
    return out
