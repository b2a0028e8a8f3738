"""connector/core/pairing.py: P and D derive the same transfer id from the X-Request-Id
however vLLM decorated it, and P's answer carries D everything it needs in both flows."""

from __future__ import annotations

import re
import uuid

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.core import pairing
from connector.core.messages import TransferId
from connector.kv_params import KvParamsError, agent_name, parse_decode_leg, parse_prefill_leg

# What vllm-router 0.1.17 sends P (observed against stand-in servers).
VLLM_ROUTER_P_LEG = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def router_id(p: str = "127.0.0.1:8100", d: str = "127.0.0.1:8200") -> str:
    """vllm-router's X-Request-Id (generate_vllm_request_id)."""
    return f"___prefill_addr_{p}___decode_addr_{d}_{uuid.uuid4().hex}"


def engine_id_of(x: str, endpoint: str, index: int, randomize: bool) -> str:
    """vLLM's engine request id for X-Request-Id ``x`` (0.26 and 0.32: the serving layer's
    prefix and per-prompt index, then InputProcessor.assign_request_id's random tail)."""
    rid = f"cmpl-{x}-{index}" if endpoint == "completions" else f"chatcmpl-{x}"
    return f"{rid}-{uuid.uuid4().hex:.8}" if randomize else rid


# Headers as clients and routers send them: UUIDs, vllm-router's ids, and ids that end
# like a decoration themselves.
x_request_ids = st.one_of(
    st.builds(router_id),
    st.uuids().map(str),
    st.from_regex(r"[A-Za-z0-9_.:/@-]{1,160}", fullmatch=True),
    st.tuples(st.sampled_from(["req", "cmpl-x", "a-1"]), st.integers(0, 10**9)).map(
        lambda t: f"{t[0]}-{t[1]}"
    ),
    st.text(alphabet="0123456789abcdef-", min_size=1, max_size=40),
)
endpoints = st.sampled_from(["completions", "chat"])


@given(x=x_request_ids, endpoint=endpoints, index=st.integers(0, 7), randomize=st.booleans())
def test_p_and_d_pair_however_vllm_decorated_the_id(
    x: str, endpoint: str, index: int, randomize: bool
) -> None:
    """P's key from its request id equals D's from the leg's remote_request_id and its own
    request id: the same X decorated by the same vLLM, each with its own random tail."""
    p_id = engine_id_of(x, endpoint, index, randomize)
    d_id = engine_id_of(x, endpoint, index, randomize)
    p_tid = pairing.transfer_id_for(pairing.request_key(p_id))
    d_tid = pairing.transfer_id_for(pairing.decode_key(x, d_id))
    assert p_tid == d_tid


@given(x=x_request_ids, endpoint=endpoints)
def test_with_vllms_random_tail_the_key_is_the_header_itself(x: str, endpoint: str) -> None:
    """vLLM's default (a random tail), one prompt: P's key is exactly X, so D pairs even
    where its own request id does not contain X (a router that sends D another header)."""
    assert pairing.request_key(engine_id_of(x, endpoint, 0, randomize=True)) == x
    assert pairing.decode_key(x, "cmpl-something-else-0-0123abcd") == x


@given(x=x_request_ids, randomize=st.booleans())
def test_each_prompt_of_a_list_has_its_own_key(x: str, randomize: bool) -> None:
    """/v1/completions with a list of prompts: one engine request per prompt, each its own
    transfer on both sides."""
    keys = {pairing.request_key(engine_id_of(x, "completions", i, randomize)) for i in range(4)}
    assert len(keys) == 4


@given(key=st.text(min_size=1, max_size=300))
def test_transfer_id_is_always_valid_and_deterministic(key: str) -> None:
    tid = pairing.transfer_id_for(key)
    assert msgspec.convert(tid, TransferId) == tid
    assert pairing.transfer_id_for(key) == tid


def test_valid_keys_travel_as_they_are_and_long_ones_hashed() -> None:
    x = router_id()
    assert pairing.transfer_id_for(x) == x
    long_x = router_id("prefill-0.prefill.llm.svc.cluster.local:8000", "decode-0.decode.llm.svc")
    tid = pairing.transfer_id_for(long_x)
    assert len(long_x) > 128 and re.fullmatch(r"rid-[0-9a-f]{48}", tid)
    assert pairing.transfer_id_for(long_x + "x") != tid


def test_a_vllm_router_prefill_leg_gets_the_request_key() -> None:
    x = router_id()
    params, derived = pairing.adapt(VLLM_ROUTER_P_LEG, f"cmpl-{x}-0-1a2b3c4d")
    assert derived and params["transfer_id"] == x
    assert "transfer_id" not in VLLM_ROUTER_P_LEG  # vLLM's dict is left alone
    leg = parse_prefill_leg(params)
    assert leg is not None and leg.transfer_id == x


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_decode": True, "transfer_id": "t1"},
        {"pushkv_probe": True},
        None,
        "not a dict",
        {"do_remote_decode": False, "do_remote_prefill": False},
    ],
)
def test_pushkv_legs_and_non_legs_pass_unchanged(params: object) -> None:
    assert pairing.adapt(params, "cmpl-r-0-1a2b3c4d") == (params, False)


def test_a_decode_leg_without_any_id_is_left_to_its_schema() -> None:
    params, derived = pairing.adapt({"do_remote_prefill": True}, "cmpl-r-0-1a2b3c4d")
    assert not derived
    with pytest.raises(KvParamsError, match="transfer_id"):
        parse_decode_leg(params)


COORDS = {"engine_id": "prefill", "host": "127.0.0.1", "port": 5600, "tp_size": 1}


def vllm_router_d_leg(answer: dict[str, object], x: str) -> dict[str, object]:
    """vllm-router's push-mode D leg: four of P's answer's fields and the X-Request-Id."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": answer["remote_engine_id"],
        "remote_host": answer["remote_host"],
        "remote_port": answer["remote_port"],
        "tp_size": answer["tp_size"],
        "remote_request_id": x,
    }


incarnations = st.one_of(st.just(""), st.from_regex(r"[0-9a-f]{8}", fullmatch=True))


@given(
    engine=st.from_regex(r"[A-Za-z0-9_#.-]{1,24}", fullmatch=True),
    incs=st.lists(incarnations, min_size=1, max_size=8),
    port=st.integers(1, 60000),
)
def test_both_flows_reach_every_p_rank(engine: str, incs: list[str], port: int) -> None:
    """P's answer as the sequential flow hands it to D, and the four fields vllm-router's
    push mode forwards, both give D P's engine id, each rank's agent and port."""
    tp = len(incs)
    agents = [agent_name(engine, r, inc) for r, inc in enumerate(incs)]
    coords = {**COORDS, "engine_id": engine, "port": port, "tp_size": tp, "agents": agents}
    coords["ports"] = [port + r for r in range(tp)]
    x = router_id()
    answer = pairing.answer_params(coords, x)
    assert answer["transfer_mode"] == "push"
    for d_params in (answer, vllm_router_d_leg(answer, x)):
        params, _ = pairing.adapt(d_params, f"cmpl-{x}-0-0badcafe")
        leg = parse_decode_leg(params)
        assert leg is not None and leg.transfer_id == x
        assert leg.remote_engine_id == engine and leg.remote_tp_size == tp
        assert [leg.agent_of(r) for r in range(tp)] == agents
        assert [leg.port_of(r) for r in range(tp)] == coords["ports"]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"ports": [5600, 5700]}, "ports not consecutive"),
        ({"agents": ["prefill-tp0-a", "somebody-else"]}, "agent names not pushkv's"),
        ({"engine_id": "e" * 250}, "the reference is no valid name"),
    ],
)
def test_push_mode_only_where_the_forwarded_fields_suffice(
    change: dict[str, object], why: str
) -> None:
    """Otherwise no transfer_mode: vllm-router stays sequential and hands D P's whole
    answer, which still reaches every rank."""
    engine = str(change.get("engine_id", "prefill"))
    coords: dict[str, object] = {
        **COORDS,
        "tp_size": 2,
        "ports": [5600, 5601],
        "agents": [agent_name(engine, 0, "a"), agent_name(engine, 1, "b")],
        **change,
    }
    answer = pairing.answer_params(coords, "t1")
    assert "transfer_mode" not in answer, why
    leg = parse_decode_leg(pairing.adapt(answer, "cmpl-d-0-0badcafe")[0])
    assert leg is not None and leg.transfer_id == "t1"
    assert list(leg.agents) == coords["agents"] and list(leg.ports) == coords["ports"]


def test_an_engine_reference_naming_other_ranks_is_refused() -> None:
    leg = {
        "do_remote_prefill": True,
        "transfer_id": "t1",
        "remote_engine_id": f"prefill{pairing.REF_MARK}aa.bb",
        "remote_host": "h",
        "remote_port": 1,
        "tp_size": 1,
    }
    with pytest.raises(pairing.ForeignLegError, match="names 2 ranks for remote_tp_size 1"):
        pairing.adapt(leg, "cmpl-d-0-0badcafe")


def test_plain_coordinates_answer_with_the_plain_engine_id() -> None:
    answer = pairing.answer_params(COORDS, "t1")
    assert answer["remote_engine_id"] == "prefill" and answer["transfer_mode"] == "push"
    assert "remote_agents" not in answer and answer["tp_size"] == 1


def test_pipeline_stages_on_p_reach_d_and_keep_routers_sequential() -> None:
    """P at TP 2 x PP 2: its answer names both stages (NixlConnector's ``pp_size`` too),
    and no ``transfer_mode``: the four fields vllm-router's push mode forwards do not say
    how many stages D must wait for, so such a router hands D P's whole answer."""
    agents = [agent_name("prefill", r, f"{r:08x}") for r in range(4)]
    coords = {**COORDS, "tp_size": 2, "pp_size": 2, "ports": [5600 + r for r in range(4)]}
    answer = pairing.answer_params({**coords, "agents": agents}, "t1")
    assert "transfer_mode" not in answer
    assert (answer["pp_size"], answer["remote_pp_size"]) == (2, 2)
    leg = parse_decode_leg(pairing.adapt(answer, "cmpl-d-0-0badcafe")[0])
    assert leg is not None and (leg.remote_tp_size, leg.p_stages) == (2, 2)
    assert [leg.agent_of(r) for r in range(4)] == agents
    assert [leg.port_of(r) for r in range(4)] == coords["ports"]


def test_a_foreign_legs_pp_size_and_engine_reference_name_every_stage() -> None:
    """vLLM's NixlPushConnector legs name P's stages ``pp_size``; an engine reference must
    then name one incarnation per worker of every stage."""
    ref = f"prefill{pairing.REF_MARK}a.b.c.d"
    leg = {
        "do_remote_prefill": True,
        "transfer_id": "t1",
        "remote_engine_id": ref,
        "remote_host": "h",
        "remote_port": 7000,
        "tp_size": 2,
        "pp_size": 2,
    }
    parsed = parse_decode_leg(pairing.adapt(leg, "cmpl-d-0-0badcafe")[0])
    assert parsed is not None and parsed.p_stages == 2
    assert parsed.agent_of(3) == agent_name("prefill", 3, "d")
    with pytest.raises(pairing.ForeignLegError, match="names 4 ranks for remote_tp_size 2 x"):
        pairing.adapt({**leg, "pp_size": 3}, "cmpl-d-0-0badcafe")
