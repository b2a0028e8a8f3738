"""Where the P/D secret comes from (connector/config.py), and which P coordinates D
trusts (connector/kv_params.py: the router's signature, the allowlist)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.config import check_failure_policy, load_secret, parse_config
from connector.core.errors import ConfigError
from connector.kv_params import (
    LegTrust,
    UntrustedLeg,
    parse_decode_leg,
    sign_decode_params,
)

KEY = b"s" * 32
NOW = 1_700_000_000_000
TTL = 60_000
# A D leg from P engine "prefill" at 10.0.0.5, TP 2 (ranks on ports 5000 and 5001).
D: dict[str, Any] = dict(
    do_remote_prefill=True,
    transfer_id="t-1",
    remote_engine_id="prefill",
    remote_host="10.0.0.5",
    remote_port=5000,
    remote_tp_size=2,
    remote_ports=[5000, 5001],
    remote_agents=["prefill-tp0-a", "prefill-tp1-a"],
    traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01",
)


# -- the secret --------------------------------------------------------------------------


def test_no_secret_by_default() -> None:
    cfg = parse_config(None)
    assert load_secret(cfg) is None and not cfg.authenticated


def test_secret_from_file_env_or_inline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "secret"
    f.write_bytes(KEY + b"\n")
    assert load_secret(parse_config({"auth_secret_file": str(f)})) == KEY
    monkeypatch.setenv("MY_PUSHKV_SECRET", KEY.decode())
    assert load_secret(parse_config({"auth_secret_env": "MY_PUSHKV_SECRET"})) == KEY
    cfg = parse_config({"auth_secret": KEY.decode()})
    assert load_secret(cfg) == KEY
    assert KEY.decode() not in repr(cfg)  # never printed in a log line


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"auth_secret_file": "/nonexistent/pushkv-secret"}, "auth_secret_file"),
        ({"auth_secret_env": "PUSHKV_TEST_UNSET_VARIABLE"}, "unset or empty"),
        ({"auth_secret": "short"}, "at least 16 bytes"),
        ({"auth_secret": "x" * 20, "auth_secret_env": "HOME"}, "one place only"),
        ({"auth_window_s": 10, "write_timeout_s": 30}, "auth_window_s must be longer"),
    ],
)
def test_bad_secret_config_is_a_clear_error(extra: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_config(extra)


def test_untrusted_legs_are_recomputed_unless_refused_by_configuration() -> None:
    assert parse_config({}).untrusted_leg == "recompute"
    refuse = {"untrusted_leg": "refuse", "auth_secret": "x" * 20}
    assert parse_config(refuse).untrusted_leg == "refuse"
    listed = {"untrusted_leg": "refuse", "trusted_prefill": ["10.0.0.1"]}
    assert parse_config(listed).untrusted_leg == "refuse"
    with pytest.raises(ConfigError, match="untrusted_leg"):
        parse_config({"untrusted_leg": "drop"})
    with pytest.raises(ConfigError, match="needs a secret or trusted_prefill"):
        parse_config({"untrusted_leg": "refuse"})  # D would trust every leg: refuse nothing


def test_refuse_needs_vllms_fail_policy_on_d() -> None:
    """Under "recompute" vLLM would compute a refused leg's failed load: a start-up error."""
    cfg = parse_config({"untrusted_leg": "refuse", "auth_secret": "x" * 20})
    check_failure_policy(cfg, "fail", consumer=True)
    check_failure_policy(cfg, "recompute", consumer=False)  # P never refuses a leg
    with pytest.raises(ConfigError, match="kv_load_failure_policy 'fail'"):
        check_failure_policy(cfg, "recompute", consumer=True)
    check_failure_policy(parse_config({}), "recompute", consumer=True)


# -- signed coordinates ------------------------------------------------------------------


def signed(params: dict[str, Any] = D, key: bytes = KEY, now: int = NOW) -> dict[str, Any]:
    return sign_decode_params(params, key, now, TTL)


def check(params: dict[str, Any], trust: LegTrust, now: int = NOW) -> None:
    leg = parse_decode_leg(params)
    assert leg is not None
    trust.check(leg, now)


def test_signed_coordinates_are_trusted_until_they_expire() -> None:
    trust = LegTrust(KEY)
    check(signed(), trust)
    check(signed(), trust, NOW + TTL)
    with pytest.raises(UntrustedLeg, match="expired"):
        check(signed(), trust, NOW + TTL + 1)


def test_unsigned_or_wrongly_signed_legs_are_refused() -> None:
    trust = LegTrust(KEY)
    with pytest.raises(UntrustedLeg, match="missing"):
        check(D, trust)
    with pytest.raises(UntrustedLeg, match="bad_tag"):
        check(signed(key=b"z" * 32), trust)
    with pytest.raises(UntrustedLeg, match="malformed"):
        check({**D, "pushkv_sig": "v1.nonsense"}, trust)


@pytest.mark.parametrize(
    "field, value",
    [
        ("transfer_id", "t-2"),  # a signature is for one transfer only
        ("remote_engine_id", "evil"),
        ("remote_host", "10.6.6.6"),
        ("remote_port", 6666),
        ("remote_tp_size", 1),
        ("remote_ports", [5000, 6666]),
        ("remote_agents", ["prefill-tp0-a", "evil"]),
    ],
)
def test_tampering_with_any_coordinate_breaks_the_signature(field: str, value: Any) -> None:
    tampered = {**signed(), field: value}
    if field == "remote_tp_size":
        tampered.pop("remote_ports")
        tampered.pop("remote_agents")
    with pytest.raises(UntrustedLeg, match="bad_tag"):
        check(tampered, LegTrust(KEY))


def test_fields_outside_the_coordinates_may_change() -> None:
    check({**signed(), "traceparent": None, "extra_key": 1}, LegTrust(KEY))


@given(st.text(max_size=100))
def test_any_signature_string_is_refused_cleanly(sig: str) -> None:
    with pytest.raises(UntrustedLeg):
        check({**D, "pushkv_sig": sig}, LegTrust(KEY))


def test_allowlist_by_host_or_every_rank_port() -> None:
    check(D, LegTrust(allowed=frozenset({"10.0.0.5"})))
    check(D, LegTrust(allowed=frozenset({"10.0.0.5:5000", "10.0.0.5:5001"})))
    with pytest.raises(UntrustedLeg, match="not in trusted_prefill"):
        check(D, LegTrust(allowed=frozenset({"10.0.0.5:5000"})))  # rank 1's port is not
    # With a key as well: allowlisted or signed.
    both = LegTrust(KEY, frozenset({"10.0.0.9"}))
    check(signed(), both)
    check({**D, "remote_host": "10.0.0.9", "remote_ports": [], "remote_agents": []}, both)
    with pytest.raises(UntrustedLeg, match="and not in trusted_prefill"):
        check(D, both)


def test_no_key_no_allowlist_trusts_any_leg_as_before() -> None:
    assert LegTrust().open
    check(D, LegTrust())
