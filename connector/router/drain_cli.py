"""``pushkv drain``: take one P or D out of rotation on every router that sends it legs and
wait until none of its legs is in flight there (``--undrain`` puts it back). One command for
a rolling restart's step, or a Kubernetes preStop hook (deploy/k8s/base/decode.yaml).

    pushkv drain --router http://pushkv-router:8000 --role decode \\
        --backend http://pushkv-decode-0.pushkv-decode:8000 --wait 20

Each router gets ``POST /admin/backends/{role}/{backend}/drain?wait=S`` at once
(``connector.router.drain``). Exit 0: drained and idle on every router; 1: legs still in
flight past ``--wait`` on one (it stays drained there); 2: a router refused or could not be
reached. The routers' admin key comes from ``PUSHKV_ROUTER_API_KEY``, never a flag.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Sequence
from urllib.parse import quote

import httpx

from connector.router.config import ENV_API_KEY

DRAINED, IN_FLIGHT, FAILED = 0, 1, 2
SLACK_S = 10.0  # beyond --wait: the router's answer itself, on a busy host


async def change_one(
    client: httpx.AsyncClient, router: str, role: str, backend: str, action: str, wait_s: float
) -> tuple[int, str]:
    """One router's answer to the drain (or undrain): an exit code and a line saying it."""
    url = f"{router.rstrip('/')}/admin/backends/{role}/{quote(backend, safe='')}/{action}"
    params = {"wait": f"{wait_s:g}"} if action == "drain" else {}
    try:
        r = await client.post(url, params=params, timeout=wait_s + SLACK_S)
    except httpx.HTTPError as exc:
        return FAILED, f"{router}: {type(exc).__name__}: {exc}"
    if r.status_code == 200:
        entry = r.json()
        return DRAINED, (
            f"{router}: {role} {backend} {action}ed, {entry.get('outstanding')} leg(s) in flight"
        )
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text[:200]
    return (IN_FLIGHT if r.status_code == 409 else FAILED), f"{router}: {r.status_code} {message}"


async def change(
    routers: Sequence[str],
    role: str,
    backend: str,
    *,
    undrain: bool = False,
    wait_s: float = 20.0,
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[int, list[str]]:
    """Drain (or undrain) ``backend`` on every router at once: the worst exit code, and one
    line per router."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    action = "undrain" if undrain else "drain"
    async with httpx.AsyncClient(headers=headers, trust_env=False, transport=transport) as c:
        answers = await asyncio.gather(
            *(change_one(c, r, role, backend, action, wait_s) for r in routers)
        )
    return max(code for code, _ in answers), [line for _, line in answers]


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="pushkv drain", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--router", action="append", required=True, help="a router's URL (repeat for each)"
    )
    p.add_argument("--role", required=True, choices=("prefill", "decode"))
    p.add_argument(
        "--backend", required=True, help="its URL as the router knows it, or its index there"
    )
    p.add_argument(
        "--wait", type=float, default=20.0, help="seconds its legs in flight may take (20)"
    )
    p.add_argument("--undrain", action="store_true", help="put it back in rotation instead")
    args = p.parse_args(argv)
    if args.wait < 0:
        p.error("--wait must be 0 or more seconds")
    code, lines = asyncio.run(
        change(
            args.router,
            args.role,
            args.backend,
            undrain=args.undrain,
            wait_s=args.wait,
            api_key=os.environ.get(ENV_API_KEY),
        )
    )
    for line in lines:
        print(line)
    return code
