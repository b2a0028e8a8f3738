"""The push protocol end to end over real NIXL between real processes (DRAM, loopback).

Each rank is a child process running the real transport, endpoint and transfer thread on
a synthetic KV cache. Bytes landed in D are checked against an element-wise reference
written here (independent of the layout planner); every byte outside it must stay zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import numpy as np
import pytest

from connector.core import events as ev
from connector.core.state import ReceiverPolicy, SenderPolicy
from connector.tools.loopback import RankProcess, RankSpec, expected_event
from connector.tools.stack import free_port
from tests.budget import BOUNDS, Budget, RecordProperty, cpu_shares, proc_cpu_s

pytestmark = [pytest.mark.nixl]

MS = 1_000_000


@pytest.fixture
def cluster() -> Iterator[Callable[..., RankProcess]]:
    started: list[RankProcess] = []

    def start(
        role: str, engine: str, rank: int = 0, tp: int = 1, target: object = None, **kw: object
    ) -> RankProcess:
        """``target``: the rank's main, if not ``rank_main`` (test_push_hosts: in a netbed host)."""
        proc = RankProcess(RankSpec(role, engine, rank, tp, free_port(), **kw), target=target)  # type: ignore[arg-type]
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
    assert not any(p.proc.is_alive() for p in started)


def reference(
    d: RankSpec,
    ps: list[RankSpec],
    p_bufs: list[np.ndarray],
    p_blocks: tuple[int, ...],
    d_blocks: tuple[int, ...],
    num_tokens: int,
    first_token: int = 0,
) -> np.ndarray:
    """What D's buffer must hold: element by element, from the lowest P rank with the head."""
    out = np.zeros(d.shape(), dtype=np.uint8)
    for t in range(first_token, num_tokens):
        for h in range(*d.heads):
            p = min(i for i, s in enumerate(ps) if s.heads[0] <= h < s.heads[1])
            src_spec = ps[p]
            pb, po = p_blocks[t // src_spec.block_size], t % src_spec.block_size
            db, do = d_blocks[(t - first_token) // d.block_size], t % d.block_size
            ph, dh = h - src_spec.heads[0], h - d.heads[0]
            src = p_bufs[p][:, pb, ph, po] if src_spec.order == "HND" else p_bufs[p][:, pb, po, ph]
            if d.order == "HND":
                out[:, db, dh, do] = src
            else:
                out[:, db, do, dh] = src
    return out


def run_transfer(
    p_ranks: list[RankProcess],
    d_ranks: list[RankProcess],
    *,
    tid: str,
    p_blocks: tuple[int, ...],
    d_blocks: tuple[int, ...],
    num_tokens: int,
    first_token: int = 0,
    registration_first: bool = True,
) -> None:
    p_specs = [p.spec for p in p_ranks]
    prefill = ev.PrefillDone(tid, f"preq-{tid}", (p_blocks,), num_tokens)

    def expect_all() -> None:
        for d in d_ranks:
            d.submit(expected_event(tid, p_specs, d.spec, d_blocks, num_tokens, first_token))

    if registration_first:
        expect_all()
        for p in p_ranks:
            p.wait("registration", lambda r: r.counters().transfers >= 1, timeout_s=10)
        for p in p_ranks:
            p.submit(prefill)
    else:
        for p in p_ranks:
            p.submit(prefill)
        expect_all()
    for d in d_ranks:
        d.wait(f"received {tid}", lambda r: any(x.transfer_id == tid for x in r.received), 20)
        (got,) = [x for x in d.received if x.transfer_id == tid]
        assert got.ok, f"{d.spec.agent}: transfer failed: {got}"
    for p in p_ranks:
        p.wait(f"blocks of {tid} freed", lambda r: f"preq-{tid}" in r.sent, 20)


def check_bytes(p_ranks: list[RankProcess], d_ranks: list[RankProcess], **kw: object) -> None:
    p_specs = [p.spec for p in p_ranks]
    p_bufs = [p.read() for p in p_ranks]
    for d in d_ranks:
        got, want = d.read(), reference(d.spec, p_specs, p_bufs, **kw)  # type: ignore[arg-type]
        bad = np.argwhere(got != want)
        assert bad.size == 0, (
            f"{d.spec.agent}: {len(bad)} bytes differ, first at {bad[:3].tolist()}"
        )
        assert np.count_nonzero(want) > 0


@pytest.mark.parametrize(
    "registration_first", [True, False], ids=["register-first", "prefill-first"]
)
def test_one_p_into_one_d(cluster: Callable[..., RankProcess], registration_first: bool) -> None:
    p, d = cluster("P", "prefill"), cluster("D", "decode")
    blocks = dict(p_blocks=(1, 2, 3, 9), d_blocks=(7, 3, 12, 5), num_tokens=60)
    run_transfer([p], [d], tid="t-1", registration_first=registration_first, **blocks)
    check_bytes([p], [d], **blocks)
    # A second transfer into other blocks reuses the connection; the first stays intact.
    more = dict(p_blocks=(20, 21), d_blocks=(30, 31), num_tokens=32)
    run_transfer([p], [d], tid="t-2", registration_first=not registration_first, **more)
    p_buf, d_buf = p.read(), d.read()
    want = reference(d.spec, [p.spec], [p_buf], **blocks) + reference(
        d.spec, [p.spec], [p_buf], **more
    )
    assert np.array_equal(d_buf, want)
    (report,) = [r for r in p.reports if r.transfer_id == "t-2"]
    assert report.ok and report.bytes_total == 2 * 32 * 4 * 64 and report.descriptors == 2


def test_two_p_ranks_into_one_d_rank(cluster: Callable[..., RankProcess]) -> None:
    ps = [cluster("P", "prefill", rank=r, tp=2) for r in range(2)]
    d = cluster("D", "decode", p_tp=2)
    blocks = dict(p_blocks=(4, 0, 6), d_blocks=(10, 11, 2), num_tokens=40)
    run_transfer(ps, [d], tid="tp21", **blocks)
    check_bytes(ps, [d], **blocks)


def test_one_p_rank_into_two_d_ranks(cluster: Callable[..., RankProcess]) -> None:
    p = cluster("P", "prefill")
    ds = [cluster("D", "decode", rank=r, tp=2) for r in range(2)]
    blocks = dict(p_blocks=(5, 6, 7), d_blocks=(1, 9, 4), num_tokens=48)
    run_transfer([p], ds, tid="tp12", **blocks)
    check_bytes([p], ds, **blocks)


@pytest.mark.parametrize("p_bs, d_bs", [(16, 32), (32, 16)])
def test_block_sizes_differ_and_prefix_hit(
    cluster: Callable[..., RankProcess], p_bs: int, d_bs: int
) -> None:
    p = cluster("P", "prefill", block_size=p_bs)
    d = cluster("D", "decode", block_size=d_bs, order="NHD")
    n = 100
    p_blocks = tuple(range(40, 40 + -(-n // p_bs)))
    # D already holds the first 32 tokens (a prefix-cache hit): only the suffix moves.
    d_blocks = tuple(range(50, 50 - (-(n - 32) // d_bs)))
    blocks = dict(p_blocks=p_blocks, d_blocks=d_blocks, num_tokens=n, first_token=32)
    run_transfer([p], [d], tid=f"bs{p_bs}-{d_bs}", **blocks)
    check_bytes([p], [d], **blocks)


def test_decode_killed_before_the_write_fails_on_p(cluster: Callable[..., RankProcess]) -> None:
    p = cluster("P", "prefill", send_policy=SenderPolicy(lease_ns=30_000 * MS))
    d = cluster("D", "decode")
    d.submit(expected_event("dead-d", [p.spec], d.spec, (1, 2), 32))
    p.wait("registration", lambda r: r.counters().transfers >= 1, timeout_s=10)
    d.kill()
    p.submit(ev.PrefillDone("dead-d", "preq-dead-d", ((1, 2),), 32))
    # The WRITE (or the dial) fails; P gives its blocks back well before the lease.
    p.wait("blocks freed after the failed WRITE", lambda r: "preq-dead-d" in r.sent, timeout_s=15)
    (report,) = [r for r in p.reports if r.transfer_id == "dead-d"]
    assert not report.ok and report.reason is not None


def test_decode_killed_during_a_large_write(cluster: Callable[..., RankProcess]) -> None:
    big = dict(num_layers=8, num_blocks=512, block_size=32, token_bytes=512)  # 256 MiB per rank
    p = cluster("P", "prefill", **big)
    d = cluster("D", "decode", **big)
    blocks = tuple(range(0, 512, 1))[::-1]  # scattered on D: many descriptors, a slow WRITE
    d.submit(expected_event("big", [p.spec], d.spec, blocks, 512 * 32))
    p.wait("registration", lambda r: r.counters().transfers >= 1, timeout_s=10)
    p.submit(ev.PrefillDone("big", "preq-big", (tuple(range(512)),), 512 * 32))
    d.kill()
    p.wait("an outcome for the interrupted WRITE", lambda r: "preq-big" in r.sent, timeout_s=30)


def test_prefill_killed_gives_decode_a_failure(cluster: Callable[..., RankProcess]) -> None:
    p = cluster("P", "prefill")
    d = cluster(
        "D",
        "decode",
        recv_policy=ReceiverPolicy(
            timeout_ns=3_000 * MS, grace_ns=1_000 * MS, heartbeat_interval_ns=200 * MS
        ),
    )
    d.submit(expected_event("dead-p", [p.spec], d.spec, (1, 2), 32))
    p.wait("registration", lambda r: r.counters().transfers >= 1, timeout_s=10)
    p.kill()
    d.wait("a definite outcome", lambda r: any(x.transfer_id == "dead-p" for x in r.received), 15)
    (got,) = d.received
    assert not got.ok


def test_registration_for_a_prefill_that_never_comes_expires(
    cluster: Callable[..., RankProcess],
) -> None:
    p = cluster("P", "prefill")
    d = cluster(
        "D", "decode", recv_policy=ReceiverPolicy(timeout_ns=1_500 * MS, grace_ns=1_000 * MS)
    )
    d.submit(expected_event("orphan", [p.spec], d.spec, (1, 2), 32))
    d.wait("an outcome", lambda r: bool(r.received), timeout_s=15)
    assert not d.received[0].ok
    # P answered D's cancel (or its own expiry) with a Fail: D did not have to abandon.
    assert d.counters().endpoint.get("send_failed", 0) == 0


# Each idle rank: under 5 % of a core (`make perf`); 20 % in CI still catches a busy loop.
IDLE_RANK_CPU = Budget("idle_rank_cpu_share", precise=0.05, unit="%")


@pytest.mark.parametrize("bound", BOUNDS)
def test_idle_pair_uses_almost_no_cpu(
    cluster: Callable[..., RankProcess], record_property: RecordProperty, bound: str
) -> None:
    p, d = cluster("P", "prefill"), cluster("D", "decode")
    blocks = dict(p_blocks=(1,), d_blocks=(2,), num_tokens=16)
    run_transfer([p], [d], tid="warm", **blocks)  # connected both ways, then idle
    shares = cpu_shares({x.spec.agent: partial(proc_cpu_s, x.pid) for x in (p, d)}, 10.0)
    for agent, share in shares.items():
        IDLE_RANK_CPU.check(record_property, bound, share, agent)


@pytest.mark.parametrize(
    "p_bell, d_bell",
    [(True, True), (True, False), (False, True)],
    ids=["both", "d-without", "p-without"],
)
def test_doorbells_wake_both_sides_and_a_peer_without_one_is_only_slower(
    cluster: Callable[..., RankProcess], p_bell: bool, d_bell: bool
) -> None:
    p, d = cluster("P", "prefill", doorbell=p_bell), cluster("D", "decode", doorbell=d_bell)
    blocks = dict(p_blocks=(1, 2), d_blocks=(7, 3), num_tokens=32)
    run_transfer([p], [d], tid="bell-0", **blocks)
    check_bytes([p], [d], **blocks)
    run_transfer(
        [p],
        [d],
        tid="bell-1",
        registration_first=False,
        p_blocks=(5, 6),
        d_blocks=(17, 13),
        num_tokens=32,
    )
    p_heard = p.counters().thread.get("bell_heard", 0)
    d_heard = d.counters().thread.get("bell_heard", 0)
    # D's registrations ring P; P rings D when it posts a WRITE.
    assert (p_heard >= 2) == (p_bell and d_bell), f"P heard {p_heard} bells"
    assert (d_heard >= 2) == (p_bell and d_bell), f"D heard {d_heard} bells"
