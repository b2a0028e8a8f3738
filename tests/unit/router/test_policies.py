"""The backend-choice policies (connector/router/chooser.py, affinity.py, signals.py), pure:
given each backend's health, outstanding legs and engine signals, which one is chosen and why."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.router import affinity
from connector.router.chooser import KV_WEIGHT, Chooser, Policy, engine_cost
from connector.router.policy import BackendLoad, Health, Signals
from connector.router.signals import KV_USAGE, RUNNING, WAITING, parse_signals

NOW = 100.0
STALE_S = 3.0


def backend(
    i: int,
    outstanding: int = 0,
    *,
    waiting: float | None = None,
    running: float = 0,
    kv: float = 0.0,
    age: float = 0.5,
    health: Health = Health.HEALTHY,
) -> BackendLoad:
    sig = None if waiting is None else Signals(waiting, running, kv, NOW - age)
    return BackendLoad(
        i, health=health, outstanding=outstanding, key=f"http://d{i}:8000", signals=sig
    )


def chooser(policy: Policy, max_imbalance: float = 4.0) -> Chooser:
    return Chooser(policy, stale_s=STALE_S, max_imbalance=max_imbalance)


def hashes(text: str) -> tuple[int, ...]:
    return affinity.block_hashes(text, 8)


# -- engine-load ---------------------------------------------------------------------------


def test_engine_cost_reads_the_queue_the_kv_and_at_least_the_routers_own_legs() -> None:
    assert engine_cost(backend(0, 2, waiting=3, running=4, kv=0.5), NOW, STALE_S) == (
        7 + 3 + KV_WEIGHT * 0.5
    )
    # Legs sent since the last scrape count: the engine's queue cannot be below them.
    assert engine_cost(backend(0, 9, waiting=1, running=2), NOW, STALE_S) == 9 + 1
    # No signals, or stale ones: the router's own count only.
    assert engine_cost(backend(0, 2), NOW, STALE_S) == 2
    assert engine_cost(backend(0, 2, waiting=50, age=STALE_S + 0.1), NOW, STALE_S) == 2


def test_engine_load_moves_away_from_an_engine_with_a_queue_the_router_did_not_send() -> None:
    # Same outstanding count (what least-load sees); d0's engine has a long prompt queue.
    busy, idle = backend(0, 1, waiting=6, running=2), backend(1, 1, waiting=0, running=1)
    assert chooser(Policy.LEAST_LOAD).choose("decode", [busy, idle], (), NOW).load is busy  # type: ignore[union-attr]
    c = chooser(Policy.ENGINE_LOAD).choose("decode", [busy, idle], (), NOW)
    assert c is not None and c.load is idle
    assert c.reason.startswith("engine-load: cost 1.00: waiting 0, running 1")


def test_engine_load_counts_kv_usage() -> None:
    full, empty = backend(0, waiting=0, running=2, kv=0.95), backend(1, waiting=0, running=3)
    c = chooser(Policy.ENGINE_LOAD).choose("decode", [full, empty], (), NOW)
    assert c is not None and c.load is empty  # 2 + 3.8 > 3


def test_engine_load_ignores_stale_signals() -> None:
    # d0's last scrape said it was idle, but that was long ago; d1's fresh one is busy.
    stale = backend(0, 4, waiting=0, running=0, age=STALE_S + 1)
    fresh = backend(1, 0, waiting=1, running=1)
    c = chooser(Policy.ENGINE_LOAD).choose("decode", [stale, fresh], (), NOW)
    assert c is not None and c.load is fresh  # 4 outstanding > (1 + 1) + 1 waiting
    c = chooser(Policy.ENGINE_LOAD).choose("decode", [stale], (), NOW)
    assert c is not None and "signals 4.0 s old, 4 outstanding" in c.reason


def test_policies_still_use_a_suspect_backend_only_when_none_is_healthy() -> None:
    suspect = backend(0, waiting=0, health=Health.SUSPECT)
    loaded = backend(1, 5, waiting=9)
    for policy in Policy:
        c = chooser(policy).choose("decode", [suspect, loaded], hashes("x" * 40), NOW)
        assert c is not None and c.load is loaded, policy
        c = chooser(policy).choose("decode", [suspect], hashes("x" * 40), NOW)
        assert c is not None and c.load is suspect, policy
        assert chooser(policy).choose("decode", [backend(2, health=Health.DOWN)], (), NOW) is None


# -- prefix --------------------------------------------------------------------------------


def test_prefix_repeats_go_to_the_backend_that_took_the_prefix() -> None:
    ch = chooser(Policy.PREFIX)
    ds = [backend(i, waiting=0) for i in range(4)]
    shared = "system: you are a helpful assistant. " * 4
    first = ch.choose("decode", ds, hashes(shared + "question one"), NOW)
    assert first is not None and first.prefix_blocks == 0
    assert first.reason.startswith("prefix: new prefix, rendezvous on its first block")
    first.load.outstanding += 1  # its leg is in flight: least-load would go elsewhere now
    again = ch.choose("decode", ds, hashes(shared + "another question"), NOW)
    assert again is not None and again.load is first.load
    assert again.prefix_blocks == len(shared) // 8
    assert again.reason.startswith(f"prefix: holds {len(shared) // 8} of ")
    # The table is per role: P's choice is its own.
    assert ch.choose("prefill", ds, hashes(shared), NOW).prefix_blocks == 0  # type: ignore[union-attr]


def test_prefix_holder_is_passed_over_beyond_the_imbalance_bound() -> None:
    ch = chooser(Policy.PREFIX, max_imbalance=2.0)
    ds = [backend(0, waiting=0), backend(1, waiting=0)]
    prompt = hashes("a shared prefix of some length")
    holder = ch.choose("decode", ds, prompt, NOW)
    assert holder is not None
    other = ds[1 - holder.load.index]
    holder.load.signals = Signals(2, 1, 0.0, NOW)  # cost 5 > 0 + 2
    c = ch.choose("decode", ds, prompt, NOW)
    assert c is not None and c.load is other and c.prefix_blocks == 0
    assert f"[{holder.load.index}] holds {len(prompt)} but cost 5.00 > bound 2.00" in c.reason
    # The other now holds it too (it computed it): the next repeat stays there.
    c = ch.choose("decode", ds, prompt, NOW)
    assert c is not None and c.load is other and c.prefix_blocks == len(prompt)


def test_longest_held_prefix_wins() -> None:
    ch = chooser(Policy.PREFIX)
    ds = [backend(0, waiting=0), backend(1, waiting=0)]
    ch.table("decode").record(hashes("A" * 16), 0)  # d0 holds 2 blocks
    ch.table("decode").record(hashes("A" * 32), 1)  # d1 holds 4 (and, since, the first 2)
    ch.table("decode").record(hashes("A" * 16), 0)  # d0 took the 2-block prefix again
    c = ch.choose("decode", ds, hashes("A" * 40 + "tail"), NOW)
    assert c is not None and c.load.index == 1 and c.prefix_blocks == 4


def test_prefix_under_one_block_goes_by_engine_load() -> None:
    c = chooser(Policy.PREFIX).choose("decode", [backend(0, 1), backend(1)], (), NOW)
    assert c is not None and c.load.index == 1
    assert c.reason.startswith("prefix: prompt under one block; engine-load:")


def test_rendezvous_is_the_same_in_any_order_and_a_removal_moves_only_its_prefixes() -> None:
    keys = [f"http://d{i}:8000" for i in range(5)]
    firsts = [h[0] for h in (hashes(f"{n:04d} prompt") for n in range(300))]
    won = {f: keys[affinity.rendezvous(f, keys)] for f in firsts}
    assert len(set(won.values())) == 5  # spread over all of them
    rev = keys[::-1]
    assert all(rev[affinity.rendezvous(f, rev)] == won[f] for f in firsts)
    left = [k for k in keys if k != keys[2]]
    for f in firsts:
        if won[f] != keys[2]:
            assert left[affinity.rendezvous(f, left)] == won[f]


@given(
    costs=st.lists(st.integers(0, 12), min_size=1, max_size=6),
    held=st.integers(0, 5),
    bound=st.integers(0, 6),
)
def test_prefix_never_picks_beyond_the_bound(costs: list[int], held: int, bound: int) -> None:
    ch = chooser(Policy.PREFIX, max_imbalance=float(bound))
    ds = [backend(i, waiting=0, running=c) for i, c in enumerate(costs)]
    prompt = hashes("the same long prefix, again")
    ch.table("decode").record(prompt, held % len(costs))
    c = ch.choose("decode", ds, prompt, NOW)
    assert c is not None and c.load.signals is not None
    assert c.load.signals.running <= min(costs) + bound
    if costs[held % len(costs)] <= min(costs) + bound:
        assert c.load.index == held % len(costs)


# -- affinity ------------------------------------------------------------------------------


def test_block_hashes_share_exactly_the_equal_leading_blocks() -> None:
    a, b = hashes("0123456789abcdefXYZ"), hashes("0123456789abcdefQQQQQQQQ")
    assert len(a) == 2 and len(b) == 3  # a partial last block is not hashed
    assert a == b[:2]
    assert hashes("x123456789abcdef")[1] != a[1]  # a change in block 0 changes every later one
    assert len(affinity.block_hashes("y" * 10**6, 64)) == affinity.MAX_BLOCKS
    with pytest.raises(ValueError):
        affinity.block_hashes("abc", 0)


def test_prefix_text_of_each_body_kind() -> None:
    assert affinity.prefix_text({"prompt": "hi"}) == "hi"
    assert affinity.prefix_text({"prompt": ["hi"]}) == "hi"
    assert affinity.prefix_text({"prompt": [1, 2, 3]}) == "1,2,3"
    assert affinity.prefix_text({"prompt": "hi", "cache_salt": "s"}) == "s\x00hi"
    chat = {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]
    }
    longer = {"messages": [*chat["messages"], {"role": "assistant", "content": "a"}]}
    t1, t2 = affinity.prefix_text(chat), affinity.prefix_text(longer)
    assert t1 is not None and t2 is not None and t2.startswith(t1)
    assert affinity.prefix_text({"model": "m"}) is None


def test_prefix_table_forgets_least_recently_used_and_by_backend() -> None:
    t = affinity.PrefixTable(capacity=4)
    t.record([1, 2, 3], 0)
    t.record([9], 1)
    t.record([1], 0)  # touched: 2 is now the oldest
    t.record([7], 1)  # 5 entries: 2 goes
    assert len(t) == 4 and t.holders([1, 2, 3]) == [(0, 3)] and t.holders([1, 2]) == [(0, 1)]
    t.record([8], 1)  # then 3
    assert t.holders([1, 2, 3]) == [(0, 1)] and t.holders([5, 9]) == [(1, 2)]
    t.forget(0)
    assert t.holders([1, 2, 3]) == [] and t.holders([9]) == [(1, 1)] and len(t) == 3


# -- signals -------------------------------------------------------------------------------

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.25
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 1234.0
"""


def test_parse_signals_sums_engines_and_averages_kv() -> None:
    s = parse_signals(VLLM_METRICS, at=7.0)
    assert s == Signals(waiting=3.0, running=3.0, kv_usage=0.375, at=7.0)


def test_parse_signals_reads_the_v0_kv_name_and_refuses_text_without_a_queue() -> None:
    v0 = VLLM_METRICS.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert parse_signals(v0, 0.0).kv_usage == 0.375  # type: ignore[union-attr]
    no_kv = "\n".join(ln for ln in VLLM_METRICS.splitlines() if "kv_cache" not in ln)
    assert parse_signals(no_kv, 0.0).kv_usage == 0.0  # type: ignore[union-attr]
    assert parse_signals("# nothing\nother_metric 1\n", 0.0) is None


def test_the_names_read_are_the_ones_the_installed_vllm_exports() -> None:
    """vLLM 0.32 and 0.26 both register these gauges (checked by hand in both venvs); this
    keeps the installed one honest."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    src = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    for name in (WAITING, RUNNING, KV_USAGE[0]):
        assert f'"{name}"' in src, name
