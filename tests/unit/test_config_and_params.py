"""kv_connector_extra_config and kv_transfer_params: validated once, clear errors."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from connector.config import parse_config
from connector.core.errors import ConfigError
from connector.kv_params import (
    KvParamsError,
    agent_name,
    is_probe,
    parse_decode_leg,
    parse_prefill_leg,
)

D = {
    "do_remote_prefill": True,
    "transfer_id": "t-1",
    "remote_engine_id": "prefill",
    "remote_host": "127.0.0.1",
    "remote_port": 5000,
}


def test_defaults_and_policies() -> None:
    cfg = parse_config(None)
    assert cfg.sender_policy().lease_ns == 30_000_000_000
    assert cfg.receiver_policy().timeout_ns > cfg.sender_policy().write_timeout_ns


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"lease_sec": 3}, "unknown field"),
        ({"lease_s": -1}, "lease_s"),
        ({"lease_s": "soon"}, "lease_s"),
        ({"heartbeat_s": 40, "lease_s": 30}, "heartbeat_s must be shorter"),
        ({"write_timeout_s": 200, "receive_timeout_s": 100}, "write_timeout_s must be shorter"),
    ],
)
def test_bad_config_is_a_clear_error(extra: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_config(extra)


def test_legs_parse_and_ignore_other_keys() -> None:
    assert (
        parse_prefill_leg({"do_remote_decode": True, "transfer_id": "x", "other": 1}).transfer_id
        == "x"
    )
    leg = parse_decode_leg({**D, "remote_tp_size": 2})
    assert [leg.port_of(r) for r in (0, 1)] == [5000, 5001]
    assert leg.agent_of(1) == agent_name("prefill", 1)
    leg = parse_decode_leg(
        {**D, "remote_ports": [7, 9], "remote_agents": ["a", "b"], "remote_tp_size": 2}
    )
    assert (leg.port_of(1), leg.agent_of(1)) == (9, "b")
    assert parse_decode_leg({"do_remote_prefill": False}) is None
    assert parse_prefill_leg(None) is None and is_probe({"pushkv_probe": True})


@pytest.mark.parametrize(
    "bad",
    [
        {"do_remote_prefill": True},
        {**D, "remote_port": 70000},
        {**D, "transfer_id": ""},
        {**D, "remote_tp_size": 2, "remote_ports": [1]},
        {**D, "remote_tp_size": 2, "remote_agents": ["a"]},
        {**D, "traceparent": "not-a-traceparent"},
        {**D, "remote_port": 65535, "remote_tp_size": 2},
    ],
)
def test_malformed_decode_leg(bad: dict) -> None:
    with pytest.raises(KvParamsError, match="kv_transfer_params|remote_"):
        parse_decode_leg(bad)


def test_a_leg_with_unset_fields_pickles_by_name() -> None:
    """Legs travel pickled in a step's metadata; UNSET goes by kv_params' own reducer, never
    by pickle's search of every loaded module (a lazy module raises there, in the engine)."""
    leg = parse_prefill_leg({"do_remote_decode": True, "transfer_id": "t1"})
    assert leg is not None and leg.tracestate is msgspec.UNSET
    data = pickle.dumps(leg, protocol=pickle.HIGHEST_PROTOCOL)
    assert b"connector.kv_params" in data and b"_unset" in data
    assert pickle.loads(data) == leg
