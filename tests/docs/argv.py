"""Check a documented command line against the real CLI without running it.

Owns: ``check_command(argv)``, which returns None when the command is accepted and a message
otherwise. ``pushkv ...`` goes through ``connector.cli.main`` and ``python -m MOD ...`` through
the module's ``__main__`` code, with ``argparse.ArgumentParser.parse_args`` patched to stop
right after a successful parse: option names, choices and types are the real ones, and
nothing starts. A module that parses no arguments is checked for existence only; ``make``
targets against the Makefile; ``streamlit run FILE`` and ``python FILE`` for the file.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import runpy
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn
from unittest import mock

from tests.docs.commands import ROOT

_PYTHONS = frozenset({"python", "python3", ".venv/bin/python", "$(PY)"})


class _Parsed(BaseException):
    """Raised by the patched parse_args: the command line was accepted (BaseException, so
    a main's ``except Exception`` cannot swallow it)."""


@contextlib.contextmanager
def _stop_after_parse() -> Iterator[None]:
    original = argparse.ArgumentParser.parse_args

    def parse_args(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> NoReturn:
        original(self, *args, **kwargs)
        raise _Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args):
        yield


def _run_parse(what: str, call: Callable[[], object]) -> str | None:
    out, err = io.StringIO(), io.StringIO()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with (
            _stop_after_parse(),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: module already imported
            call()
    except _Parsed:
        return None
    except SystemExit as exc:
        if exc.code in (0, None):  # --help
            return None
        return f"{what}: exit {exc.code}: {err.getvalue().strip()[-800:]}"
    finally:  # a main may install signal handlers before it parses (pushkv bench does)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return f"{what}: returned without parsing its arguments (would it have run?)"


def _check_pushkv(args: list[str]) -> str | None:
    from connector.cli import main

    if not args or (len(args) == 1 and not args[0].startswith("-")):
        # `pushkv` or `pushkv router` named in prose: the command must exist
        args = [*args, "--help"]
    return _run_parse("pushkv " + " ".join(args), lambda: main(args))


def _check_module(module: str, args: list[str]) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a parent package is missing
        spec = None
    if spec is None:
        return f"python -m {module}: no such module"
    if spec.submodule_search_locations is not None:  # a package: its __main__ runs
        spec = importlib.util.find_spec(module + ".__main__")
        if spec is None:
            return f"python -m {module}: a package without __main__"
    if module == "pytest":
        missing = [a for a in args if not a.startswith("-") and not _path(a.split("::")[0])]
        return f"pytest: no such test path(s) {missing}" if missing else None
    source = Path(spec.origin).read_text() if spec.origin else ""
    if "parse_args(" not in source:
        return None  # reads sys.argv itself (or nothing): existence is what can be checked

    def call() -> None:
        with mock.patch.object(sys, "argv", [module, *args]):
            runpy.run_module(module, run_name="__main__", alter_sys=True)

    return _run_parse(f"python -m {module} " + " ".join(args), call)


def _path(name: str) -> bool:
    return (ROOT / name).exists()


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([\w.-]+)\s*:(?!=)", text, flags=re.M))


def check_command(argv: list[str]) -> str | None:
    """None if the documented command would be accepted, else why not."""
    cmd, args = argv[0], argv[1:]
    if cmd == "pushkv":
        return _check_pushkv(args)
    if cmd in _PYTHONS:
        if args[:1] == ["-m"] and len(args) >= 2:
            return _check_module(args[1], args[2:])
        if args and args[0].endswith(".py"):
            return None if _path(args[0]) else f"python {args[0]}: no such file"
        return f"{' '.join(argv)}: only `python -m MOD` and `python FILE.py` are checked"
    if cmd == "make":
        unknown = [t for t in args if not t.startswith("-") and "=" not in t]
        unknown = [t for t in unknown if t not in _make_targets()]
        return f"make: no target(s) {unknown} in the Makefile" if unknown else None
    if cmd == "streamlit" and args[:1] == ["run"] and len(args) >= 2:
        return None if _path(args[1]) else f"streamlit run {args[1]}: no such file"
    if cmd in ("export", "cd"):
        return None
    return f"{' '.join(argv)}: not a command this check can parse; tag the block covered or manual"
