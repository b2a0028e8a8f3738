"""Pipeline parallelism through the vLLM adapter: P at PP > 1 is pushed, D at PP > 1 is
refused at start-up (connector/config.py's check_parallelism), and the pieces between
them: P's coordinates from vLLM's (PP rank, TP rank) handshakes, the router's D leg, D's
sources (one per writing TP rank per stage), a stage's KV numbered as the model numbers
its layers, and vLLM's split of the layers into stages.

The connector runs with small stand-ins for vLLM's config objects; the stages' protocol is
tests/unit/core/test_stages.py, their bytes tests/unit/transfer/test_pp_stages.py, real
vLLM tests/e2e/test_pp_e2e.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import connector.vllm_compat as compat
from connector.config import PushkvConfig, check_parallelism
from connector.core.errors import ConfigError, LayoutError
from connector.core.heads import head_range
from connector.core.stages import PipelineStage
from connector.kv_params import (
    Coordinates,
    KvParamsError,
    LegTrust,
    UntrustedLeg,
    agent_name,
    parse_decode_leg,
    sign_decode_leg,
)
from connector.kv_tensors import check_stage_layers, describe_kv_caches
from connector.metadata import Handshake
from connector.plugin import PushConnector
from connector.router.config import Mode
from connector.router.legs import decode_body
from connector.tools.kv_caches import vllm_kv_caches
from connector.vllm_compat import KVConnectorRole
from connector.worker_side import WorkerSide

SECRET = b"k" * 32


def vllm_config(role: str, pp: int, tp: int = 1) -> Any:
    ktc = SimpleNamespace(
        engine_id="prefill" if role == "kv_producer" else "decode",
        kv_connector_extra_config={},
        kv_load_failure_policy="recompute",
        is_kv_producer=role in ("kv_producer", "kv_both"),
        is_kv_consumer=role in ("kv_consumer", "kv_both"),
    )
    return SimpleNamespace(
        kv_transfer_config=ktc,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, rank=0),
        shutdown_timeout=0,
    )


# ---------------------------------------------------------------- start-up
@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_d_with_pipeline_stages_is_refused_at_start_up_naming_the_feature(role: str) -> None:
    with pytest.raises(ConfigError) as err:
        PushConnector(vllm_config(role, pp=2), KVConnectorRole.SCHEDULER)
    msg = str(err.value)
    assert "pipeline parallelism on D" in msg and "--pipeline-parallel-size 1" in msg
    check_parallelism(1, consumer=True)  # D at PP 1, and P at any PP, start
    check_parallelism(4, consumer=False)


def test_ps_coordinates_name_every_worker_of_every_stage() -> None:
    """vLLM hands the scheduler role each worker's handshake by (PP rank, TP rank); its
    base class refuses a PP rank past 0. P's coordinates list them by source rank."""
    conn = PushConnector(vllm_config("kv_producer", pp=2, tp=2), KVConnectorRole.SCHEDULER)
    hs = {
        (pp, tp): Handshake(agent_name("prefill", 2 * pp + tp, "x"), "10.0.0.1", 5000 + 2 * pp + tp)
        for pp in range(2)
        for tp in range(2)
    }
    conn.set_xfer_handshake_metadata_pp_aware(hs)
    assert conn._sched is not None
    coords = Coordinates(**conn._sched.coordinates())  # as the probe's answer carries them
    coords.validate()
    assert (coords.tp_size, coords.pp_size) == (2, 2)
    assert coords.ports == (5000, 5001, 5002, 5003)
    assert coords.agents == tuple(agent_name("prefill", r, "x") for r in range(4))


def test_pp_1_coordinates_are_what_they_always_were() -> None:
    conn = PushConnector(vllm_config("kv_producer", pp=1, tp=2), KVConnectorRole.SCHEDULER)
    conn.set_xfer_handshake_metadata_pp_aware(
        {(0, r): Handshake(f"a{r}", "h", 5000 + r) for r in range(2)}
    )
    assert conn._sched is not None
    assert "pp_size" not in conn._sched.coordinates()


def test_vllms_split_of_the_layers_gives_each_worker_its_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import vllm.distributed.parallel_state as ps

    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=2),
        model_config=SimpleNamespace(get_total_num_hidden_layers=lambda: 5),
    )
    got = []
    for stage in range(2):
        monkeypatch.setattr(ps, "get_pp_group", lambda s=stage: SimpleNamespace(rank_in_group=s))
        got.append(compat.pipeline_stage(config))
    # vLLM gives the extra layer to a stage before the last one
    assert got == [PipelineStage(0, 2, 0, 3, 5), PipelineStage(1, 2, 3, 5, 5)]
    config.parallel_config.pipeline_parallel_size = 1
    assert compat.pipeline_stage(config).size == 1


# ---------------------------------------------------------------- a stage's KV
def test_a_stages_regions_are_numbered_as_the_model_numbers_its_layers() -> None:
    _, views = vllm_kv_caches(5, 8, 2, 16, 32)
    stage_1 = {n: t for n, t in views.items() if int(n.split(".")[2]) >= 3}  # layers 3, 4
    check_stage_layers(stage_1, 3, 5)
    layout = describe_kv_caches(stage_1, {}, (0, 2), first_layer=3)
    assert [r.layer for r in layout.regions] == [3, 4]
    whole = describe_kv_caches(views, {}, (0, 2))
    assert [r.base_addr for r in whole.regions[3:]] == [r.base_addr for r in layout.regions]


def test_a_stage_whose_layers_do_not_hold_one_kv_cache_each_is_refused() -> None:
    _, views = vllm_kv_caches(4, 8, 2, 16, 32)
    with pytest.raises(LayoutError, match=r"decoder layers \[0, 3\)"):
        check_stage_layers(views, 0, 3)  # four KV caches for three decoder layers
    renamed = {n.replace("layers.0.", "layers.7."): t for n, t in views.items()}
    with pytest.raises(LayoutError, match="one KV cache"):
        check_stage_layers(renamed, 0, 4)  # not the stage's own layers
    plain = {f"attn{i}": torch.zeros(1) for i in range(3)}  # names without layer numbers
    check_stage_layers(plain, 2, 5)


# ---------------------------------------------------------------- the router's leg and D
LEG = {
    "do_remote_prefill": True,
    "transfer_id": "t1",
    "remote_engine_id": "prefill",
    "remote_host": "10.0.0.1",
    "remote_port": 5000,
    "remote_tp_size": 2,
}


def test_the_routers_d_leg_carries_ps_stages_and_its_signature_covers_them() -> None:
    coords = Coordinates("prefill", "10.0.0.1", 5000, 2, ports=(5000, 5001, 6000, 6001), pp_size=2)
    body = decode_body(
        Mode.PUSH,
        {"prompt": "x"},
        transfer_id="t1",
        traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01",
        request_id="r1",
        coords=coords,
        sign=lambda leg: sign_decode_leg(leg, SECRET, 1000, 60_000),
    )
    leg = parse_decode_leg(body["kv_transfer_params"])
    assert leg is not None and (leg.p_stages, leg.p_workers) == (2, 4)
    assert [leg.port_of(r) for r in range(4)] == [5000, 5001, 6000, 6001]
    LegTrust(SECRET).check(leg, 2000)
    # the same four workers read as TP 4 at PP 1: D would wait for no stage
    tampered = parse_decode_leg(
        {**body["kv_transfer_params"], "remote_pp_size": 1, "remote_tp_size": 4}
    )
    assert tampered is not None
    with pytest.raises(UntrustedLeg):
        LegTrust(SECRET).check(tampered, 2000)


def test_a_pp_1_legs_signature_is_unchanged() -> None:
    """A router and a D of before pipeline stages agree on a PP 1 leg's signature."""
    leg = parse_decode_leg(LEG)
    assert leg is not None and leg.p_stages == 1
    signed = sign_decode_leg(leg, SECRET, 1000, 60_000)
    assert "remote_pp_size" not in signed.params()
    LegTrust(SECRET).check(signed, 2000)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"remote_pp_size": 2, "remote_ports": [1, 2]}, "2 entries for remote_tp_size 2 x"),
        ({"remote_pp_size": 2, "remote_agents": ["a"] * 3}, "3 entries"),
        ({"remote_pp_size": 0}, "remote_pp_size"),
        ({"remote_pp_size": 2048, "remote_tp_size": 4}, "4096 P workers"),
        ({"remote_pp_size": 3, "remote_port": 65531}, "past port 65535"),
    ],
)
def test_malformed_stage_coordinates_are_clear_errors(extra: dict[str, Any], says: str) -> None:
    with pytest.raises(KvParamsError, match=says):
        parse_decode_leg({**LEG, **extra})


@pytest.mark.parametrize(("p_tp", "pp", "heads"), [(1, 2, 2), (2, 2, 2), (2, 3, 2), (4, 2, 2)])
def test_d_waits_for_each_writing_tp_rank_in_each_stage(p_tp: int, pp: int, heads: int) -> None:
    """D at TP 1 (both heads): every P TP rank writes some; D at TP 2: its head's writer."""
    leg = parse_decode_leg(
        {**LEG, "remote_tp_size": p_tp, "remote_pp_size": pp, "remote_engine_id": "p"}
    )
    assert leg is not None
    for d_tp in (1, 2):
        for d in range(d_tp):
            side = WorkerSide(PushkvConfig(), "decode", False, True, d, d_tp, heads, 16, {})
            got = side._sources(leg)
            writers = [p for p in range(p_tp) if _holds(p, p_tp, d, d_tp, heads)]
            assert [s.p_rank for s in got] == [s * p_tp + p for s in range(pp) for p in writers]
            assert [s.addr.port for s in got] == [5000 + s.p_rank for s in got]
            assert [s.addr.agent for s in got] == [agent_name("p", s.p_rank) for s in got]


def _holds(p: int, p_tp: int, d: int, d_tp: int, heads: int) -> bool:
    """P TP rank p is the lowest holder of some head D rank d holds."""
    held = [head_range(q, p_tp, heads) for q in range(p_tp)]
    lo, hi = head_range(d, d_tp, heads)
    return any(min(q for q, (a, b) in enumerate(held) if a <= h < b) == p for h in range(lo, hi))
