"""The router's security settings: its own API key (401 without it, health open), the
backends' key (never the client's header), and the signature on P's coordinates in D's
leg (docs/security.md)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from connector.core.errors import ConfigError
from connector.kv_params import LegTrust, UntrustedLeg, parse_decode_leg
from connector.router.apikey import bearer
from connector.router.config import (
    ENV_API_KEY,
    ENV_AUTH_SECRET,
    ENV_BACKEND_API_KEY,
    RouterConfig,
    parse_args,
)
from tests.unit.router.test_choice_and_modes import COMPLETION

from .conftest import MakeCluster

pytestmark = pytest.mark.anyio
KEY = "router-key-123"
SECRET = b"p/d-shared-secret-0123456789"


async def test_api_key_required_on_every_route_but_health(cluster: MakeCluster) -> None:
    c = await cluster(api_key=KEY)
    assert (await c.client.get("/health")).status_code == 200
    for method, path, body in (
        ("POST", "/v1/completions", COMPLETION),
        ("POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user"}]}),
        ("GET", "/v1/models", None),
        ("GET", "/router/stats", None),
        ("GET", "/nowhere", None),
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = await c.client.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == 401
    assert c.d[0].requests == [] and c.p[0].requests == []  # nothing reached a backend
    ok = {"Authorization": f"Bearer {KEY}"}
    r = await c.client.post("/v1/completions", json=COMPLETION, headers=ok)
    assert r.status_code == 200
    stats = (await c.client.get("/router/stats", headers=ok)).json()
    assert stats["requests"]["unauthorized"] == 15


async def test_client_key_never_reaches_a_backend(cluster: MakeCluster) -> None:
    c = await cluster(api_key=KEY)
    ok = {"Authorization": f"Bearer {KEY}"}
    assert (await c.client.post("/v1/completions", json=COMPLETION, headers=ok)).status_code == 200
    for seen in (c.p[0].requests[0], c.d[0].requests[0]):
        assert "authorization" not in seen.headers


async def test_backend_key_replaces_the_clients(cluster: MakeCluster) -> None:
    c = await cluster(backend_api_key="backend-key")
    r = await c.client.post(
        "/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer client"}
    )
    assert r.status_code == 200
    for seen in (c.p[0].requests[0], c.d[0].requests[0], c.p[0].probes[0]):
        assert seen.headers["authorization"] == "Bearer backend-key"


async def test_without_keys_the_clients_header_is_forwarded_as_before(
    cluster: MakeCluster,
) -> None:
    c = await cluster()
    headers = {"Authorization": "Bearer client"}
    assert (await c.client.post("/v1/completions", json=COMPLETION, headers=headers)).is_success
    assert c.d[0].requests[0].headers["authorization"] == "Bearer client"


async def test_d_leg_carries_a_signature_d_accepts(cluster: MakeCluster) -> None:
    c = await cluster(auth_secret=SECRET)
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    leg = parse_decode_leg(c.d_kv())
    assert leg is not None and leg.pushkv_sig
    now = time.time_ns() // 1_000_000
    LegTrust(SECRET).check(leg, now)  # D with the same secret dials it
    with pytest.raises(UntrustedLeg, match="expired"):
        LegTrust(SECRET).check(leg, now + 61_000)  # --coords-ttl 60 by default
    assert "pushkv_sig" not in c.p_kv()


async def test_without_a_secret_d_legs_are_unsigned(cluster: MakeCluster) -> None:
    c = await cluster()
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert "pushkv_sig" not in c.d_kv()


def test_bearer_parsing() -> None:
    assert bearer(b"Bearer abc") == b"abc"
    assert bearer(b"bearer   abc ") == b"abc"
    for bad in (None, b"", b"Bearer", b"Bearer ", b"Basic abc", b"abc"):
        assert bearer(bad) is None


BASE = ["--prefill", "http://p:1", "--decode", "http://d:2", "--port", "0"]


def test_flags_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (ENV_API_KEY, ENV_AUTH_SECRET, ENV_BACKEND_API_KEY):
        monkeypatch.delenv(var, raising=False)
    cfg = parse_args(BASE)
    assert (cfg.api_key, cfg.backend_api_key, cfg.auth_secret) == (None, None, None)
    monkeypatch.setenv(ENV_API_KEY, "from-env")
    monkeypatch.setenv(ENV_BACKEND_API_KEY, "backend-env")
    monkeypatch.setenv(ENV_AUTH_SECRET, SECRET.decode())
    cfg = parse_args(BASE)
    assert (cfg.api_key, cfg.backend_api_key, cfg.auth_secret) == (
        "from-env",
        "backend-env",
        SECRET,
    )
    assert "from-env" not in repr(cfg) and SECRET.decode() not in repr(cfg)
    (tmp_path / "b").write_text("backend-file\n")
    (tmp_path / "s").write_text("s" * 20)
    cfg = parse_args(
        [
            *BASE,
            "--api-key",
            "flag",
            "--backend-api-key-file",
            str(tmp_path / "b"),
            "--auth-secret-file",
            str(tmp_path / "s"),
            "--coords-ttl",
            "5",
        ]
    )
    assert (cfg.api_key, cfg.backend_api_key, cfg.auth_secret, cfg.coords_ttl_s) == (
        "flag",
        "backend-file",
        b"s" * 20,
        5.0,
    )


def test_short_secret_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        RouterConfig(("http://p:1",), ("http://d:2",), auth_secret=b"short")
