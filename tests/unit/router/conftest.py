"""Fixtures for the router tests: mock P/D servers and a router in front of them, all
served on 127.0.0.1 in the test's event loop (anyio's pytest plugin, asyncio backend).

Owns: ``cluster`` (a factory; everything it starts is stopped at teardown, gates released
first so no mock handler is left waiting).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import pytest

from connector.router import arrival
from connector.router.app import RouterState, create_app
from connector.router.config import Mode, RouterConfig
from tests.unit.router.mock_backend import MockBackend
from tests.unit.router.serving import WAIT_S, InLoopServer, within


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn serves on asyncio


def p_coords(i: int) -> dict[str, Any]:
    return {"engine_id": f"p{i}-engine", "host": f"10.0.0.{i + 1}", "port": 5600 + i, "tp_size": 1}


def p_pull_params(i: int) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [1, 2, 3],
        "remote_engine_id": f"p{i}-engine",
        "remote_request_id": f"cmpl-p{i}-0",
        "remote_host": "localhost",
        "remote_port": 5600 + i,
        "tp_size": 1,
    }


@dataclass
class Cluster:
    p: list[MockBackend]
    d: list[MockBackend]
    p_servers: list[InLoopServer]
    d_servers: list[InLoopServer]
    router: InLoopServer
    state: RouterState
    client: httpx.AsyncClient

    async def check_health(self) -> None:
        """One health round now (the tests' health interval is an hour)."""
        await self.state.backends.check_all()

    async def background_done(self) -> None:
        """Wait for P legs still running after their D answer went out."""
        tasks = list(self.state.background)
        if tasks:
            await within(asyncio.wait(tasks), "the background P leg(s) to end")

    def d_kv(self, i: int = 0, d: int = 0) -> dict[str, Any]:
        return self.d[d].requests[i].body["kv_transfer_params"]

    def p_kv(self, i: int = 0, p: int = 0) -> dict[str, Any]:
        return self.p[p].requests[i].body["kv_transfer_params"]


class MakeCluster(Protocol):
    async def __call__(
        self,
        n_p: int = 1,
        n_d: int = 1,
        *,
        mode: Mode = Mode.PUSH,
        setup: Callable[[list[MockBackend], list[MockBackend]], None] | None = None,
        tracer: Any = None,
        **config: Any,
    ) -> Cluster: ...


@pytest.fixture
async def cluster() -> AsyncIterator[MakeCluster]:
    async with contextlib.AsyncExitStack() as stack:
        mocks: list[MockBackend] = []

        def release_all() -> None:
            for m in mocks:
                m.release()

        async def make(
            n_p: int = 1,
            n_d: int = 1,
            *,
            mode: Mode = Mode.PUSH,
            setup: Callable[[list[MockBackend], list[MockBackend]], None] | None = None,
            tracer: Any = None,
            **config: Any,
        ) -> Cluster:
            ps = [
                MockBackend(
                    f"p{i}",
                    coords=p_coords(i),
                    pull_params=(p_pull_params(i) if mode is Mode.PULL else None),
                )
                for i in range(n_p)
            ]
            ds = [MockBackend(f"d{i}") for i in range(n_d)]
            mocks.extend(ps + ds)
            if setup is not None:
                setup(ps, ds)
            servers = [InLoopServer(m.app()) for m in ps + ds]
            for s in servers:
                await s.start()
                stack.push_async_callback(s.stop)
            config.setdefault("health_interval_s", 3600.0)  # rounds only when a test asks
            # A check that times out takes a new or down backend out; on a loaded host the
            # in-loop /health may take over the product's 1 s: bound it like every wait here.
            config.setdefault("health_timeout_s", WAIT_S)
            cfg = RouterConfig(
                prefill_urls=tuple(s.url for s in servers[:n_p]),
                decode_urls=tuple(s.url for s in servers[n_p:]),
                mode=mode,
                **config,
            )
            app = create_app(cfg, tracer)
            router = await InLoopServer(app, http=arrival.protocol()).start()
            stack.push_async_callback(router.stop)
            # Runs first at teardown: no handler is left waiting on a gate.
            stack.callback(release_all)
            client = httpx.AsyncClient(base_url=router.url, timeout=30.0, trust_env=False)
            stack.push_async_callback(client.aclose)
            return Cluster(ps, ds, servers[:n_p], servers[n_p:], router, app.state.router, client)

        yield make
