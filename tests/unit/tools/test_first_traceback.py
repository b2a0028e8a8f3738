"""A server that dies in start-up: its first traceback (the root cause vLLM's last one points
"above" to) is found in its log, through the exception line, process prefixes and all."""

from __future__ import annotations

from pathlib import Path

from connector.tools.stack import first_traceback

LOG = """\
$ python -m vllm.entrypoints.openai.api_server --port 1
(APIServer pid=7) INFO starting
(EngineCore pid=9) Traceback (most recent call last):
(EngineCore pid=9)   File "core.py", line 1, in run
(EngineCore pid=9)     bind(port)
(EngineCore pid=9) OSError: [Errno 98] Address already in use
(APIServer pid=7) INFO more lines
Traceback (most recent call last):
  File "utils.py", line 2, in wait_for_engine_startup
RuntimeError: Engine core initialization failed. See root cause above.
"""


def test_the_first_traceback_ends_at_its_exception_line(tmp_path: Path) -> None:
    log = tmp_path / "decode.log"
    log.write_text(LOG)
    first = first_traceback(log)
    assert first.splitlines()[0].endswith("Traceback (most recent call last):")
    assert first.splitlines()[-1].endswith("OSError: [Errno 98] Address already in use")
    assert "RuntimeError" not in first and len(first.splitlines()) == 4


def test_no_traceback_or_no_log_gives_nothing(tmp_path: Path) -> None:
    log = tmp_path / "ok.log"
    log.write_text("INFO fine\n")
    assert first_traceback(log) == ""
    assert first_traceback(tmp_path / "missing.log") == ""


def test_a_long_traceback_keeps_its_head_and_its_exception(tmp_path: Path) -> None:
    frames = "".join(f'  File "f{i}.py", line {i}, in g\n' for i in range(100))
    log = tmp_path / "long.log"
    log.write_text(f"Traceback (most recent call last):\n{frames}ValueError: deep\n")
    first = first_traceback(log, max_lines=20)
    lines = first.splitlines()
    assert len(lines) == 20 and lines[0].startswith("Traceback") and lines[5] == "..."
    assert lines[-1] == "ValueError: deep"
