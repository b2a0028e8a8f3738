"""The extraction helpers of tests/docs/commands.py, on small made-up documents."""

from __future__ import annotations

import pytest

from tests.docs.argv import check_command
from tests.docs.commands import (
    Check,
    DocError,
    anchors,
    blocks,
    check_tagged,
    commands,
    group,
    inline_commands,
    knob_tables,
    links,
    logical_lines,
    with_ports,
)

DOC = """# Title

<!-- check: argv -->
```bash
pushkv demo --transport   # a comment
```

Some `pushkv bench --quick` prose, a synopsis `pushkv router [--mode M]` and `ls -l`.

<!-- check: e2e stack -->
```bash
P_PORT=8100
D_PORT=8200
echo $P_PORT
```

```text
not a command: pushkv nope
```

<!-- check: e2e stack -->
```bash
kill $P_PID
```
"""


def test_blocks_carry_their_tag_language_and_line() -> None:
    found = blocks(DOC)
    assert [(b.lang, b.check, b.line) for b in found] == [
        ("bash", Check("argv"), 4),
        ("bash", Check("e2e", "stack"), 11),
        ("text", None, 17),
        ("bash", Check("e2e", "stack"), 22),
    ]
    assert found[0].text == "pushkv demo --transport   # a comment\n"


def test_a_group_is_its_blocks_in_document_order() -> None:
    stack = group(blocks(DOC), "stack")
    assert [b.line for b in stack] == [11, 22]
    assert group(blocks(DOC), "other") == []


def test_untagged_shell_blocks_and_bare_fences_are_refused() -> None:
    for text in ("```bash\nls\n```\n", "```\nls\n```\n", "<!-- check: run -->\n```text\nx\n```\n"):
        with pytest.raises(DocError):
            check_tagged(blocks(text)[0])
    for text in (
        "<!-- check: covered -->\n```bash\nls\n```\n",
        "<!-- check: argv x -->\n```sh\nls\n```\n",
    ):
        with pytest.raises(DocError):
            check_tagged(blocks(text)[0])
    with pytest.raises(DocError, match="unknown check kind"):
        blocks("<!-- check: maybe -->\n```bash\nls\n```\n")
    with pytest.raises(DocError, match="never closed"):
        blocks("```bash\nls\n")


def test_indented_fences_lose_their_indent() -> None:
    (b,) = blocks("- item\n\n  <!-- check: run -->\n  ```bash\n  echo hi\n  ```\n")
    assert b.check == Check("run") and b.text == "echo hi\n"


def test_inline_commands_skip_synopses_fences_and_other_tools() -> None:
    assert inline_commands(DOC) == ["pushkv bench --quick"]


def test_commands_split_lines_separators_and_assignments() -> None:
    script = (
        "export A=1 B=2\n"
        "X=1 Y=2\n"
        "# a comment\n"
        "VLLM=0 taskset -c 0 vllm serve $M \\\n"
        "  --port $P_PORT > p.log 2>&1 &\n"
        "kill $A $B; wait\n"
        "pushkv router --prefill 'http://h:1' && echo ok  # done\n"
    )
    assert logical_lines("a \\\n  b\n\n# c\nd\n") == ["a    b", "d"]
    assert commands(script) == [
        ["export", "A=1", "B=2"],
        [
            "taskset",
            "-c",
            "0",
            "vllm",
            "serve",
            "$M",
            "--port",
            "$P_PORT",
            ">",
            "p.log",
            "2",
            ">&",
            "1",
        ],
        ["kill", "$A", "$B"],
        ["wait"],
        ["pushkv", "router", "--prefill", "http://h:1"],
        ["echo", "ok"],
    ]


def test_ports_are_substituted_once_each() -> None:
    script = "P_PORT=8100\nD_PORT=8200\ncurl http://h:$P_PORT/x  # P_PORT=8100 is P\n"
    with pytest.raises(DocError, match="P_PORT"):
        with_ports(script, {"P_PORT": 1})
    out = with_ports("P_PORT=8100\nD_PORT=8200\necho $P_PORT\n", {"P_PORT": 1, "D_PORT": 2})
    assert out == "P_PORT=1\nD_PORT=2\necho $P_PORT\n"
    with pytest.raises(DocError, match="ROUTER_PORT"):
        with_ports(out, {"ROUTER_PORT": 3})


def test_links_anchors_and_knob_tables() -> None:
    text = (
        "## Running P, D and the router\n"
        "See [ops](docs/operations.md#tracing) and ![img](x.png).\n"
        "```text\n[not](a-link.md)\n```\n"
        "### `pushkv` knobs: extra\n"
        "<!-- knobs: connector.config:PushkvConfig -->\n"
        "| key | default | what |\n|---|---|---|\n| `lease_s` | `30.0` | lease |\n\nafter\n"
    )
    assert links(text) == ["docs/operations.md#tracing"]
    assert anchors(text) == {"running-p-d-and-the-router", "pushkv-knobs-extra"}
    (table,) = knob_tables(text)
    assert table.target == "connector.config:PushkvConfig" and table.rows == {"lease_s": "30.0"}


@pytest.mark.parametrize(
    ("argv", "ok"),
    [
        (["pushkv", "bench", "--quick"], True),
        (["pushkv", "router"], True),  # a subcommand named in prose
        (["pushkv", "router", "--mode", "pull"], False),  # --prefill, --decode, --port missing
        (["pushkv", "bench", "--configs", "no-such-config"], False),
        (["pushkv", "no-such-command"], False),
        (["python", "-m", "connector.tools.tinymodel", "--seed", "1"], True),
        (["python", "-m", "connector.tools.tinymodel", "--no-such-flag"], False),
        (["python", "-m", "no.such.module"], False),
        (["python", "-m", "pytest", "-q", "tests/docs"], True),
        (["python", "-m", "pytest", "tests/no_such_dir"], False),
        (["make", "test"], True),
        (["make", "no-such-target"], False),
        (["streamlit", "run", "dashboard/app.py", "--", "--run-dir", "x"], True),
        (["docker", "compose", "up"], False),
    ],
)
def test_check_command_parses_without_running(argv: list[str], ok: bool) -> None:
    assert (check_command(argv) is None) == ok, check_command(argv)
