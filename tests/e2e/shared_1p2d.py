"""The 1 P + 2 D stack that the routing and rolling-restart tests share (its start-up is
2-5 minutes on a loaded 2-core box; a router is seconds).

Owns: the stack's layout (P on core 0, D0 on core 1, D1 beside P: loading D0 leaves D1 its
core), its start with warm-up, and ``extra_router``, another router process on the same
servers for a test that needs a policy, member list or drain state of its own. The stack's
own router runs ``--policy prefix``. D runs ``kv_load_failure_policy: fail`` (the rolling
restart needs it: a failed load is a 500 the router retries, so a lost transfer shows; the
shutdown test asserts that error); no routing test sees a failed load. The session fixture
lives in ``tests/e2e/conftest.py``, which runs the users of this stack one after the other
(the one that restarts servers, then the one that stops them, last) and stops it after its
last user.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from connector.tools.hoststack import HostStack, Instance
from connector.tools.pdstack import (
    ROUTER_HEALTH_TIMEOUT_S,
    RouterProcess,
    distinct_free_ports,
    trace_env,
)
from connector.tools.stack import ServerError
from tests.e2e.clients import concurrently
from tests.e2e.greedy import greedy_body

FIXTURE = "one_p_two_d"  # the conftest fixture's name, which its ordering hook looks for
START_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 60.0
ROUTER_START_S = 60.0


def start(model: Path, run_dir: Path) -> HostStack:
    """The stack, healthy, each server and the router warmed up; stopped again on failure."""
    s = HostStack(
        model,
        run_dir,
        prefill_instances=(Instance("0"),),
        decode_instances=(Instance("1"), Instance("0")),
        on_hosts=False,
        kv_load_failure_policy="fail",
        router_args=["--policy", "prefix", "--signals-interval", "0.5"],
        # vLLM stores Responses API answers only with this (a conversation test continues one)
        server_env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"},
    )
    try:
        s.start(START_TIMEOUT_S)
        print(f"\n[1p2d] healthy after {s.start_duration_s:.1f} s\n{s.describe()}")
        # A fresh server's first logprobs requests take seconds: every server's at once,
        # then the router's.
        concurrently(*(functools.partial(_warm_up, x.url) for x in s.servers))
        _warm_up(s.url)
    except ServerError:
        print(f"\n[1p2d] errors in the servers' logs:\n{s.log_errors()}")
        s.stop()
        raise
    except BaseException:
        s.stop()
        raise
    return s


def _warm_up(url: str) -> None:
    with httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S, trust_env=False) as c:
        resp = c.post("/v1/completions", json=greedy_body("warm up", max_tokens=2))
        assert resp.status_code == 200, f"warm-up via {url}: {resp.text}"


class AnyHealth(RouterProcess):
    """Ready once /health answers 200: "degraded" (no P yet) too."""

    def ready(self, health: httpx.Response) -> bool:
        return health.status_code == 200


@contextlib.contextmanager
def extra_router(
    stack: HostStack,
    name: str,
    prefills: Sequence[str],
    decodes: Sequence[str],
    args: Sequence[str] = (),
) -> Iterator[RouterProcess]:
    """Another router on ``stack``'s servers, as the stack's own is started but with ``args``
    for its policy and members; healthy on entry (with no P: "degraded"), stopped on leaving."""
    (port,) = distinct_free_ports(1)
    r = (RouterProcess if prefills else AnyHealth)(
        list(prefills),
        list(decodes),
        port,
        extra_args=["--health-timeout", str(ROUTER_HEALTH_TIMEOUT_S), *args],
        log_path=stack.run_dir / f"router-{name}.log",
        env=trace_env(stack.run_dir),
    )
    r.start()
    try:
        r.wait_healthy(ROUTER_START_S)
        yield r
    finally:
        r.stop()
