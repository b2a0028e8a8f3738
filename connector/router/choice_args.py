"""The router's flags for backend choice and membership: ``--policy`` and its knobs
(``chooser.py``), ``--members-file`` (``discovery.py``). Split from ``config.py`` to keep
that module short; ``config.build_parser`` adds them, ``config.parse_args`` reads them.

Must not import: httpx, starlette, uvicorn, vLLM, NIXL (see ``config.py``).
"""

from __future__ import annotations

import argparse
from typing import Any

from connector.router.chooser import Policy


def add_to(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("backend choice and membership (docs/routers.md)")
    c.add_argument(
        "--policy",
        choices=[x.value for x in Policy],
        default=Policy.LEAST_LOAD.value,
        help="least-load: the router's outstanding legs; engine-load: the engines' queues and "
        "KV usage (their /metrics); prefix: the backend holding the prompt's prefix",
    )
    c.add_argument(
        "--signals-interval", type=float, default=1.0, metavar="S", help="/metrics read every S s"
    )
    c.add_argument(
        "--prefix-block-chars",
        type=int,
        default=64,
        metavar="N",
        help="prefix policy: prompts are compared in blocks of N characters",
    )
    c.add_argument(
        "--max-imbalance",
        type=float,
        default=4.0,
        metavar="COST",
        help="prefix policy: a prefix holder is passed over once its cost (about one unit "
        "per queued request) is more than COST above the least-loaded backend's",
    )
    c.add_argument(
        "--members-file",
        metavar="PATH",
        help="P and D listed in a file re-read at run time ('prefill URL', 'decode dns://NAME:PORT')",
    )
    c.add_argument("--members-interval", type=float, default=5.0, metavar="S")


def config_of(a: argparse.Namespace) -> dict[str, Any]:
    """``RouterConfig``'s fields from these flags."""
    return {
        "policy": Policy(a.policy),
        "signals_interval_s": a.signals_interval,
        "prefix_block_chars": a.prefix_block_chars,
        "max_imbalance": a.max_imbalance,
        "members_file": a.members_file,
        "members_interval_s": a.members_interval,
    }
