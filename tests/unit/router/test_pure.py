"""The router's pure parts: policy, leg building, trace context, config and CLI parsing."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from msgspec import structs

from connector.core.errors import ConfigError, RemoteProtocolError
from connector.router import legs
from connector.router.config import Mode, RouterConfig, parse_args
from connector.router.coords import CoordOverride, PrefillCoords
from connector.router.policy import BackendLoad, Health, choose, unavailable_reason

# -- policy ------------------------------------------------------------------------------


def healthy(i: int, outstanding: int = 0, dispatched: int = 0) -> BackendLoad:
    b = BackendLoad(i, health=Health.HEALTHY, outstanding=outstanding, dispatched=dispatched)
    return b


def test_choose_least_outstanding_then_fewest_served_then_index() -> None:
    assert choose([healthy(0, 2), healthy(1, 1), healthy(2, 1)]).index == 1  # type: ignore[union-attr]
    assert choose([healthy(0, 1, 9), healthy(1, 1, 3)]).index == 1  # type: ignore[union-attr]
    assert choose([healthy(0, 0, 3), healthy(1, 0, 3)]).index == 0  # type: ignore[union-attr]


def test_choose_skips_ineligible() -> None:
    down = BackendLoad(0, health=Health.DOWN)
    suspect = BackendLoad(1, health=Health.SUSPECT)
    unknown = BackendLoad(2)
    not_ready = BackendLoad(3, health=Health.HEALTHY, ready=False)
    assert choose([down, unknown, not_ready]) is None
    assert choose([down, healthy(4, outstanding=50)]).index == 4  # type: ignore[union-attr]
    # A suspect backend only when no healthy one is left (the only P lost one connection).
    assert choose([down, suspect, unknown, not_ready]) is suspect
    assert choose([suspect, healthy(5, outstanding=50)]).index == 5  # type: ignore[union-attr]
    assert choose([BackendLoad(6, health=Health.SUSPECT, ready=False)]) is None
    assert unavailable_reason([suspect], [healthy(0)]) is None
    assert "no healthy prefill server" in (unavailable_reason([down], [healthy(0)]) or "")


def test_choose_skips_draining_healthy_or_suspect() -> None:
    drained = BackendLoad(0, health=Health.HEALTHY, draining=True)
    drained_suspect = BackendLoad(1, health=Health.SUSPECT, draining=True)
    busy = healthy(2, outstanding=50)
    assert choose([drained, busy]) is busy
    assert choose([drained, drained_suspect]) is None  # not even as a fallback
    assert "decode[0]=healthy (draining)" in (unavailable_reason([busy], [drained]) or "")
    drained.draining = False
    assert choose([drained, busy]) is drained


@given(
    st.lists(
        st.tuples(
            st.sampled_from(list(Health)), st.booleans(), st.integers(0, 5), st.integers(0, 5)
        ),
        max_size=6,
    )
)
def test_choose_is_a_least_loaded_eligible_backend(
    rows: list[tuple[Health, bool, int, int]],
) -> None:
    loads = [
        BackendLoad(i, health=h, ready=r, outstanding=o, dispatched=o + d)
        for i, (h, r, o, d) in enumerate(rows)
    ]
    picked = choose(loads)
    pool = [b for b in loads if b.eligible] or [b for b in loads if b.fallback]
    if not pool:
        assert picked is None
        return
    assert picked is not None and picked in pool
    assert picked.outstanding == min(b.outstanding for b in pool)


def test_health_transitions() -> None:
    b = BackendLoad(0)
    assert b.record_health(True) is True  # unknown -> healthy: came back
    assert b.record_health(True) is False
    b.record_leg_failure(suspect=False)  # a 4xx: still healthy
    assert b.health is Health.HEALTHY and b.failed == 1
    b.record_leg_failure(suspect=True)
    assert b.health is Health.SUSPECT and not b.eligible
    assert b.record_health(True) is True  # suspect -> healthy: re-learn (re-probe)
    timeout = dict(answered=False)
    assert b.record_health(False, **timeout) is False and b.health is Health.HEALTHY  # slow once
    assert b.record_health(False, **timeout) is False and b.health is Health.HEALTHY
    assert b.record_health(False, **timeout) is False and b.health is Health.DOWN  # third in a row
    assert b.record_health(True) is True
    assert b.record_health(False) is False and b.health is Health.DOWN  # a 503: at once
    b.record_leg_failure(suspect=True)  # a late failure does not hide "down"
    assert b.health is Health.DOWN


def test_leg_counting() -> None:
    b = BackendLoad(0)
    b.begin_leg()
    b.begin_leg()
    b.end_leg()
    assert (b.outstanding, b.dispatched) == (1, 2)
    b.end_leg()
    with pytest.raises(ValueError):
        b.end_leg()


def test_unavailable_reason() -> None:
    assert unavailable_reason([healthy(0)], [healthy(0)]) is None
    reason = unavailable_reason(
        [BackendLoad(0, health=Health.HEALTHY, ready=False)], [BackendLoad(0, health=Health.DOWN)]
    )
    assert reason is not None
    assert "no healthy prefill server (prefill[0]=healthy (not probed))" in reason
    assert "no healthy decode server (decode[0]=down)" in reason


# -- legs --------------------------------------------------------------------------------

TP = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-01$")


def test_new_traceparent() -> None:
    a, b = legs.new_traceparent(), legs.new_traceparent()
    assert TP.match(a) and TP.match(b) and a != b
    incoming = "00-" + "1" * 32 + "-" + "2" * 16 + "-00"
    m = TP.match(legs.new_traceparent(incoming))
    assert m and m[1] == "1" * 32 and m[2] != "2" * 16
    for bad in (
        "garbage",
        "00-" + "0" * 32 + "-" + "2" * 16 + "-01",
        "ff-" + "1" * 32 + "-" + "2" * 16 + "-01",
        "00-" + "1" * 31 + "-" + "2" * 16 + "-01",
    ):
        m = TP.match(legs.new_traceparent(bad))
        assert m and m[1] != "1" * 32 and m[1] != "0" * 32


def test_request_id_from() -> None:
    assert legs.request_id_from("abc-1.2:3_x") == "abc-1.2:3_x"
    for bad in (None, "", "has space", "x" * 129, "new\nline"):
        rid = legs.request_id_from(bad)
        assert re.fullmatch(r"[0-9a-f]{32}", rid)


def _probe_answer(**pushkv: object) -> dict[str, object]:
    """P's answer to a probe whose ``kv_transfer_params["pushkv"]`` holds ``pushkv``."""
    return {"kv_transfer_params": {"pushkv": pushkv}}


def test_pull_and_probe_parsing() -> None:
    coords = legs.parse_probe_response(_probe_answer(engine_id="e", host="h", port=1, tp_size=2))
    assert coords == PrefillCoords("e", "h", 1, 2)
    for bad in (
        {},
        {"kv_transfer_params": None},
        _probe_answer(engine_id="e"),
        _probe_answer(engine_id="e", host="h", port=0, tp_size=1),
        _probe_answer(engine_id="e", host="h", port="1", tp_size=1),
    ):
        with pytest.raises(RemoteProtocolError):
            legs.parse_probe_response(bad)
    two_ranks = {"engine_id": "e", "host": "h", "port": 1, "tp_size": 2}
    full = legs.parse_probe_response(_probe_answer(**two_ranks, ports=[1, 3], agents=["a0", "a1"]))
    assert (full.ports, full.agents) == ((1, 3), ("a0", "a1"))
    for bad_lists in ({"ports": [1]}, {"agents": ["a0"]}, {"ports": [1, 0]}, {"agents": "a0a1"}):
        with pytest.raises(RemoteProtocolError):
            legs.parse_probe_response(_probe_answer(**two_ranks, **bad_lists))
    assert legs.parse_models_response({"data": [{"id": "m"}]}) == "m"
    with pytest.raises(RemoteProtocolError):
        legs.parse_models_response({"data": []})


def test_decode_body_needs_its_inputs() -> None:
    with pytest.raises(ValueError):
        legs.decode_body(Mode.PUSH, {}, transfer_id="t", traceparent="tp", request_id="r")
    with pytest.raises(ValueError):
        legs.decode_body(Mode.PULL, {}, transfer_id="t", traceparent="tp", request_id="r")


def test_prefill_body_does_not_touch_the_client_body() -> None:
    body = {
        "prompt": "x",
        "max_tokens": 9,
        "stream": True,
        "stream_options": {"a": 1},
        "extra": {"nested": [1]},
    }
    out = legs.prefill_body(
        Mode.PUSH, legs.Endpoint.COMPLETIONS, body, transfer_id="t", traceparent="tp"
    )
    out["extra"]["nested"].append(2)
    assert body == {
        "prompt": "x",
        "max_tokens": 9,
        "stream": True,
        "stream_options": {"a": 1},
        "extra": {"nested": [1]},
    }
    assert "max_completion_tokens" not in out  # only set for chat, and only if present


@pytest.mark.parametrize("token_ids", [True, False])
@pytest.mark.parametrize("min_tokens", [None, 0, 5])
def test_prefill_body_for_the_first_token_keeps_eos_masked_and_releases_on_stop(
    token_ids: bool, min_tokens: int | None
) -> None:
    """With P's token the client's (``token_ids``): min_tokens >= 1 stays 1 on P's one-token
    leg (EOS masked as on one instance), and P frees its blocks when that token stops the
    request (no D leg follows). Otherwise P's token is discarded: no min_tokens, no flag."""
    body: dict[str, object] = {"prompt": "x", "max_tokens": 9, "stream": True}
    if min_tokens is not None:
        body["min_tokens"] = min_tokens
    out = legs.prefill_body(
        Mode.PUSH,
        legs.Endpoint.COMPLETIONS,
        body,
        transfer_id="t",
        traceparent="tp",
        token_ids=token_ids,
    )
    assert out["max_tokens"] == 1
    assert out.get("min_tokens") == (1 if token_ids and min_tokens else None)
    assert out["kv_transfer_params"].get("release_on_stop", False) is token_ids
    assert out.get("return_token_ids", False) is token_ids


# -- config ------------------------------------------------------------------------------


def test_parse_args_defaults() -> None:
    cfg = parse_args(
        ["--prefill", "http://p:1/", "--decode", "http://d:2", "http://d:3", "--port", "9000"]
    )
    assert cfg.prefill_urls == ("http://p:1",) and cfg.decode_urls == ("http://d:2", "http://d:3")
    assert (cfg.mode, cfg.host, cfg.port) == (Mode.PUSH, "127.0.0.1", 9000)
    assert (cfg.timeout_s, cfg.connect_timeout_s, cfg.health_interval_s) == (300.0, 5.0, 2.0)
    assert cfg.prefill_overrides == (CoordOverride(),)


# The router's command line for two P servers and one D, before the flags under test.
TWO_PREFILLS = ["--prefill", "http://p:1", "http://p:2", "--decode", "http://d:2", "--port", "1"]


def test_parse_args_overrides_broadcast_or_per_prefill() -> None:
    cfg = parse_args(
        [
            *TWO_PREFILLS,
            "--prefill-kv-host",
            "10.0.0.1",
            "--prefill-engine-id",
            "a",
            "b",
            "--mode",
            "vllm-push",
            "--prefill-kv-port",
            "5600",
            "5601",
        ]
    )
    assert cfg.mode is Mode.VLLM_PUSH
    assert cfg.prefill_overrides == (
        CoordOverride("a", "10.0.0.1", 5600, 1),
        CoordOverride("b", "10.0.0.1", 5601, 1),
    )


@pytest.mark.parametrize(
    "extra",
    [
        ["--prefill-engine-id", "a", "b", "c"],  # 3 values for 2 URLs
        ["--mode", "vllm-push", "--prefill-engine-id", "a"],  # no host/port
        ["--mode", "nope"],
        ["--timeout", "0"],
        ["--prefill-pp-size", "0"],
        ["--mode", "pull", "--prefill-pp-size", "2"],  # vLLM's legs carry no stages
    ],
)
def test_parse_args_rejects(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args([*TWO_PREFILLS, *extra])
    assert exc.value.code == 2
    assert capsys.readouterr().out == ""  # errors go to stderr


def test_config_validation() -> None:
    with pytest.raises(ConfigError):
        RouterConfig(prefill_urls=(), decode_urls=("http://d",))
    with pytest.raises(ConfigError):
        RouterConfig(prefill_urls=("p:1",), decode_urls=("http://d",))
    with pytest.raises(ConfigError):
        RouterConfig(
            prefill_urls=("http://p",),
            decode_urls=("http://d",),
            prefill_overrides=(CoordOverride(), CoordOverride()),
        )
    with pytest.raises(ConfigError):
        RouterConfig(
            prefill_urls=("http://p",),
            decode_urls=("http://d",),
            prefill_overrides=(CoordOverride(port=70000),),
        )


def test_override_apply() -> None:
    probed = PrefillCoords("e", "h", 1, 1)
    assert CoordOverride().apply(None) is None
    assert CoordOverride().apply(probed) == probed
    assert CoordOverride(host="x").apply(None) is None
    assert CoordOverride(host="x", tp_size=4).apply(probed) == PrefillCoords("e", "x", 1, 4)
    ranked = PrefillCoords("e", "h", 1, 2, ports=(1, 5), agents=("e0", "e1"))
    assert CoordOverride(host="x").apply(ranked) == PrefillCoords(
        "e", "x", 1, 2, (1, 5), ("e0", "e1")
    )
    assert CoordOverride(port=9).apply(ranked) == PrefillCoords("e", "h", 9, 2, (), ("e0", "e1"))
    assert CoordOverride(engine_id="f").apply(ranked) == PrefillCoords("f", "h", 1, 2, (1, 5), ())
    assert CoordOverride(tp_size=4).apply(ranked) == PrefillCoords("e", "h", 1, 4)
    assert CoordOverride(tp_size=2).apply(ranked) == ranked
    full = CoordOverride("a", "b", 2, 3)
    assert full.complete and full.apply(None) == full.apply(probed) == PrefillCoords("a", "b", 2, 3)


def test_override_of_ps_stages() -> None:
    """Without a probe the stages come from --prefill-pp-size (else 1); over a probe, a
    changed count of workers (TP x stages) drops the per-worker ports and agents."""
    staged = PrefillCoords("e", "h", 1, 1, ports=(1, 5), agents=("e0", "e1"), pp_size=2)
    assert CoordOverride("a", "b", 2, 1, pp_size=2).apply(None) == PrefillCoords(
        "a", "b", 2, 1, pp_size=2
    )
    assert CoordOverride(host="x").apply(staged) == structs.replace(staged, host="x")
    assert CoordOverride(pp_size=2).apply(staged) == staged
    assert CoordOverride(pp_size=1).apply(staged) == PrefillCoords("e", "h", 1, 1)
    # Two workers either way: TP 2 x 1 stage has as many as TP 1 x 2 stages.
    assert CoordOverride(tp_size=2, pp_size=1).apply(staged) == PrefillCoords(
        "e", "h", 1, 2, ports=(1, 5), agents=("e0", "e1")
    )
    cfg = parse_args([*TWO_PREFILLS, "--prefill-pp-size", "2", "1"])
    assert [o.pp_size for o in cfg.prefill_overrides] == [2, 1]


def test_router_modes_are_the_schema_mode_values() -> None:
    """The dashboard reads pushkv.mode with telemetry.schema.RouterMode."""
    from telemetry.schema import RouterMode

    assert {m.value for m in Mode} == {m.value for m in RouterMode}


def test_router_policies_are_the_schema_policy_values() -> None:
    """The dashboard reads pushkv.route.policy with telemetry.schema.RoutePolicy."""
    from connector.router.chooser import Policy
    from telemetry.schema import RoutePolicy

    assert {p.value for p in Policy} == {p.value for p in RoutePolicy}
