"""Membership from a watched file (connector/router/discovery.py): parsing, and each round
against mock P and D servers."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from connector.router.app import create_app
from connector.router.backends import Role
from connector.router.chooser import Policy
from connector.router.discovery import Entry, parse_members, url_of
from tests.unit.router.conftest import MakeCluster, p_coords
from tests.unit.router.mock_backend import MockBackend
from tests.unit.router.serving import InLoopServer, within
from tests.unit.router.test_choice_and_modes import COMPLETION
from tests.unit.router.test_membership import serving

pytestmark = pytest.mark.anyio


def test_parse_members() -> None:
    text = """
    # the P/D pool
    prefill http://10.0.0.5:8100/   # trailing slash dropped
    decode  dns://pushkv-decode.default.svc:8200
    """
    assert parse_members(text) == [
        Entry(Role.PREFILL, "http://10.0.0.5:8100", 3),
        Entry(Role.DECODE, "dns://pushkv-decode.default.svc:8200", 4),
    ]
    for bad, words in (
        ("decode", "line 1: want 'prefill|decode URL'"),
        ("router http://x:1", "role 'router'"),
        ("decode x:1", "must start with http"),
        ("decode dns://name", "want dns://NAME:PORT"),
        ("prefill http://a:1\ndecode dns://n:1/path", "line 2"),
    ):
        with pytest.raises(ValueError, match=words):
            parse_members(bad)


def test_url_of_brackets_ipv6() -> None:
    assert url_of("10.1.2.3", 8200) == "http://10.1.2.3:8200"
    assert url_of("fd00::7", 8200) == "http://[fd00::7]:8200"


async def test_a_router_started_from_the_file_alone_serves(
    cluster: MakeCluster, tmp_path: Path
) -> None:
    p, d = MockBackend("p-file", coords=p_coords(4)), MockBackend("d-file")
    async with serving(p) as ps, serving(d) as ds:
        members = tmp_path / "members"
        members.write_text(f"prefill {ps.url}\ndecode {ds.url}\n")
        c = await cluster(0, 0, members_file=str(members), members_interval_s=3600.0)
        assert (await c.client.get("/health")).json()["status"] == "ok"  # ready at start
        assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert len(p.requests) == 1 and len(d.requests) == 1
        assert d.requests[0].body["kv_transfer_params"]["remote_engine_id"] == "p4-engine"


async def test_file_changes_add_then_drain_and_forget(cluster: MakeCluster, tmp_path: Path) -> None:
    members = tmp_path / "members"
    members.write_text("")
    c = await cluster(1, 1, members_file=str(members), members_interval_s=3600.0)
    disc = c.state.discovery
    assert disc is not None
    new = MockBackend("d-new")
    async with serving(new) as server:
        # Named by DNS (an address literal resolves to itself): one D per address.
        members.write_text(f"decode dns://127.0.0.1:{server.url.rsplit(':', 1)[1]}\n")
        await disc.round()
        (added,) = disc.managed[Role.DECODE].values()
        assert added.url == server.url and added.load.eligible and added.index == 1
        new.gate = asyncio.Event()
        c.d[0].gate = asyncio.Event()
        held = [
            asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION)) for _ in range(2)
        ]
        await new.wait_for(1, "one request at the added D")
        await c.d[0].wait_for(1, "one request at d0")

        members.write_text("decode http://not valid\n")  # a bad file changes nothing
        await disc.round()
        assert not added.load.draining and len(c.state.backends.decode) == 2

        members.write_text("# empty now\n")
        await disc.round()  # drained: its leg in flight runs on
        assert added.load.draining and len(c.state.backends.decode) == 2
        new.gate.set()
        c.d[0].gate.set()
        for t in held:
            assert (await within(t, "the requests in flight")).status_code == 200
        await disc.round()  # its legs are over: forgotten
        assert [b.url for b in c.state.backends.decode] == [c.d_servers[0].url]
        assert disc.managed[Role.DECODE] == {}
        # The flags' D is not discovery's: an empty file leaves it.
        assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200


async def test_an_unresolvable_name_changes_nothing(cluster: MakeCluster, tmp_path: Path) -> None:
    members = tmp_path / "members"
    new = MockBackend("d-new")
    async with serving(new) as server:
        members.write_text(f"decode {server.url}\n")
        c = await cluster(1, 1, members_file=str(members), members_interval_s=3600.0)
        disc = c.state.discovery
        assert disc is not None and len(disc.managed[Role.DECODE]) == 1
        members.write_text(f"decode {server.url}\ndecode dns://no-such-host.invalid:1\n")
        await disc.round()
        assert len(disc.managed[Role.DECODE]) == 1
        assert not next(iter(disc.managed[Role.DECODE].values())).load.draining


async def test_two_replicas_send_a_new_prefix_to_the_same_d(cluster: MakeCluster) -> None:
    """Several routers behind one address: neither has seen the prefix, and each lists the
    Ds in another order, yet both send it to the same D (rendezvous on its first block)."""
    c = await cluster(1, 3, policy=Policy.PREFIX, prefix_block_chars=16)
    cfg = c.state.config
    other = create_app(
        replace(cfg, decode_urls=cfg.decode_urls[::-1], prefill_overrides=())
    )  # the same servers, listed backwards
    server = await InLoopServer(other).start()
    try:
        async with httpx.AsyncClient(base_url=server.url, trust_env=False) as b:
            for n in range(6):
                body = {**COMPLETION, "prompt": f"replica test {n}: " + "shared context " * 8}
                assert (await c.client.post("/v1/completions", json=body)).status_code == 200
                assert (await b.post("/v1/completions", json=body)).status_code == 200
                holders = {
                    d.name: sum(r.body["prompt"] == body["prompt"] for r in d.requests) for d in c.d
                }
                assert sorted(holders.values()) == [0, 0, 2], (n, holders)  # one D, both legs
    finally:
        await server.stop()
    assert sum(1 for d in c.d if d.requests) >= 2  # the prefixes spread over the Ds
