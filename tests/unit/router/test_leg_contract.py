"""The legs the router builds are the structs the connector parses (``connector.kv_params``):
each mode's ``kv_transfer_params`` key by key and in order, and each pushkv leg parsed back
into the value it was built from."""

from __future__ import annotations

import json

from connector.kv_params import (
    PARAMS_FIELD,
    DecodeLeg,
    LegTrust,
    PrefillLeg,
    parse_decode_leg,
    parse_prefill_leg,
    sign_decode_leg,
)
from connector.router import legs
from connector.router.config import Mode
from connector.router.coords import CoordOverride, PrefillCoords

TP = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
COORDS = PrefillCoords("p-engine", "10.0.0.1", 5600, 2, (5600, 5700), ("a0", "a1"))
KEY = b"k" * 32


def _keys(params: dict[str, object]) -> list[str]:
    return list(json.loads(json.dumps(params)))


def _prefill(mode: Mode, token_ids: bool = False) -> dict[str, object]:
    body = legs.prefill_body(
        mode,
        legs.Endpoint.COMPLETIONS,
        {"prompt": "x"},
        transfer_id="t-1",
        traceparent=TP,
        token_ids=token_ids,
    )
    params: dict[str, object] = body[PARAMS_FIELD]
    return params


def _decode(mode: Mode, **kw: object) -> dict[str, object]:
    body = legs.decode_body(
        mode, {"prompt": "x"}, transfer_id="t-1", traceparent=TP, request_id="r-1", **kw
    )
    params: dict[str, object] = body[PARAMS_FIELD]
    return params


def test_push_prefill_leg_round_trips() -> None:
    params = _prefill(Mode.PUSH)
    assert _keys(params) == ["do_remote_decode", "do_remote_prefill", "transfer_id", "traceparent"]
    assert parse_prefill_leg(params) == PrefillLeg(
        do_remote_decode=True, transfer_id="t-1", traceparent=TP
    )
    first_token = _prefill(Mode.PUSH, token_ids=True)
    assert first_token["release_on_stop"] is True
    leg = parse_prefill_leg(first_token)
    assert leg is not None and leg.release_on_stop is True


def test_push_decode_leg_round_trips_signed_and_continued() -> None:
    params = _decode(
        Mode.PUSH,
        coords=COORDS,
        remote_num_tokens=7,
        sign=lambda leg: sign_decode_leg(leg, KEY, 1_000, 60_000),
    )
    assert _keys(params) == [
        "do_remote_prefill",
        "do_remote_decode",
        "transfer_id",
        "remote_engine_id",
        "remote_host",
        "remote_port",
        "remote_tp_size",
        "traceparent",
        "remote_ports",
        "remote_agents",
        "remote_num_tokens",
        "pushkv_sig",
    ]
    assert params["do_remote_decode"] is False
    leg = parse_decode_leg(params)
    assert leg is not None
    assert (leg.port_of(1), leg.agent_of(1), leg.covered(100)) == (5700, "a1", 7)
    LegTrust(KEY).check(leg, 2_000)  # the signature D checks is the one the router made


def test_push_decode_leg_leaves_unset_fields_out() -> None:
    params = _decode(Mode.PUSH, coords=PrefillCoords("e", "h", 1, 1))
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": "t-1",
        "remote_engine_id": "e",
        "remote_host": "h",
        "remote_port": 1,
        "remote_tp_size": 1,
        "traceparent": TP,
    }
    assert parse_decode_leg(params) == DecodeLeg(
        do_remote_prefill=True,
        transfer_id="t-1",
        remote_engine_id="e",
        remote_host="h",
        remote_port=1,
        traceparent=TP,
    )


def test_vllm_modes_send_vllms_own_keys() -> None:
    for mode in (Mode.VLLM_PUSH, Mode.PULL):
        assert _prefill(mode) == {"do_remote_decode": True, "do_remote_prefill": False}
    params = _decode(Mode.VLLM_PUSH, coords=COORDS)
    assert list(params.items()) == [
        ("do_remote_decode", False),
        ("do_remote_prefill", True),
        ("remote_engine_id", "p-engine"),
        ("remote_host", "10.0.0.1"),
        ("remote_port", 5600),
        ("tp_size", 2),
        ("pp_size", 1),
        ("remote_request_id", "r-1"),
        ("transfer_id", "t-1"),
    ]


def test_pull_overrides_replace_only_the_flags_given() -> None:
    p_params = {"remote_block_ids": [1], "remote_host": "localhost", "remote_port": 1, "x": 0}
    out = legs.apply_pull_overrides(p_params, CoordOverride(host="10.2.3.4", tp_size=2))
    assert list(out.items()) == [
        ("remote_block_ids", [1]),
        ("remote_host", "10.2.3.4"),
        ("remote_port", 1),
        ("x", 0),
        ("tp_size", 2),
    ]
    assert _decode(Mode.PULL, prefill_params=out) == out


def test_refusal_is_read_from_ps_answer_only_when_it_says_so() -> None:
    assert legs.refusal({PARAMS_FIELD: {"pushkv_error": "no blocks"}}) == "no blocks"
    for answer in ({}, {PARAMS_FIELD: None}, {PARAMS_FIELD: {"transfer_id": "t"}}):
        assert legs.refusal(answer) is None
