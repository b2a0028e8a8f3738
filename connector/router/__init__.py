"""pushkv's router: an OpenAI-compatible front for disaggregated P/D vLLM servers.

Public API: ``RouterConfig`` / ``Mode`` / ``CoordOverride`` / ``parse_args`` (config),
``create_app(config)`` (the ASGI app) and ``main(argv)`` (``pushkv router ...``). Reading
order: README.md.

This module imports only the config (plain data); httpx, starlette and uvicorn are loaded
when ``create_app`` or ``main`` is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from connector.router.config import Mode, RouterConfig, parse_args
from connector.router.coords import CoordOverride, PrefillCoords

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = [
    "CoordOverride",
    "Mode",
    "PrefillCoords",
    "RouterConfig",
    "create_app",
    "main",
    "parse_args",
]


def create_app(config: RouterConfig, tracer: Any = None) -> Starlette:
    from connector.router.app import create_app as _create_app

    return _create_app(config, tracer)


def main(argv: list[str]) -> int:
    """Run the router: ``argv`` is the arguments after ``pushkv router``."""
    from connector.router.app import main as _main

    return _main(argv)
