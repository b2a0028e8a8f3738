"""The push protocol across simulated hosts: each engine in a network namespace of its own.

P and D ranks run the real transport, endpoint and transfer thread (``connector.tools.
loopback``) inside ``connector.tools.netbed`` hosts: UCX over TCP on the host's veth only (no
shared memory, no loopback between engines), side channels and doorbells bound to the host's
address. Bytes are checked element by element as in ``test_push_loopback``. Skipped, with
the reason, where namespaces cannot be created (not root).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from test_push_loopback import check_bytes, cluster, run_transfer  # noqa: F401  (a fixture)

from connector.core.state import ReceiverPolicy
from connector.tools.loopback import RankProcess, expected_event, rank_main
from connector.tools.netbed import Host, InHost, NetBed

pytestmark = [pytest.mark.nixl, pytest.mark.netns]

MS = 1_000_000


@pytest.fixture
def bed(netbed: Callable[[int], NetBed]) -> NetBed:
    return netbed(2)  # 0 for P, 1 for D


@pytest.fixture
def ranks(bed: NetBed, cluster: Callable[..., RankProcess]) -> Callable[..., RankProcess]:  # noqa: F811
    """``ranks(role, engine, host, rank=0, tp=1, **spec)``: a rank inside ``host``."""

    def start(role: str, engine: str, host: Host, rank: int = 0, tp: int = 1, **kw: object):
        target = InHost(host, rank_main, host.ucx_env())
        return cluster(role, engine, rank, tp, target=target, host=host.addr, **kw)

    return start


def test_one_p_into_one_d_across_hosts(bed: NetBed, ranks: Callable[..., RankProcess]) -> None:
    p_host, d_host = bed.hosts
    p, d = ranks("P", "prefill", p_host), ranks("D", "decode", d_host)
    before = bed.link_bytes(d_host)
    blocks = dict(p_blocks=(1, 2, 3, 9), d_blocks=(7, 3, 12, 5), num_tokens=60)
    run_transfer([p], [d], tid="h-1", **blocks)
    check_bytes([p], [d], **blocks)
    # The second transfer goes the other way round (prefill first) on the same connection.
    more = dict(p_blocks=(20, 21), d_blocks=(30, 31), num_tokens=32)
    run_transfer([p], [d], tid="h-2", registration_first=False, **more)
    (report,) = [r for r in p.reports if r.transfer_id == "h-2"]
    assert report.ok and report.bytes_total == 2 * 32 * 4 * 64
    # The metadata crossed between the hosts over the side channel (bound to their addresses).
    dials = [r.counters().transport.get("side_dials_ok", 0) for r in (p, d)]
    assert sum(dials) >= 1, dials
    # Every byte went through D's veth: the KV (6 blocks x 2 layers x 4 KiB) and the rest.
    assert bed.link_bytes(d_host) - before > 6 * 2 * 4 * 16 * 64


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2)], ids=["P-TP2-D-TP1", "P-TP1-D-TP2"])
def test_tp_sizes_differ_across_hosts(
    bed: NetBed, ranks: Callable[..., RankProcess], p_tp: int, d_tp: int
) -> None:
    p_host, d_host = bed.hosts  # an engine's ranks share its host, as on a real node
    ps = [ranks("P", "prefill", p_host, rank=r, tp=p_tp) for r in range(p_tp)]
    ds = [ranks("D", "decode", d_host, rank=r, tp=d_tp, p_tp=p_tp) for r in range(d_tp)]
    blocks = dict(p_blocks=(4, 0, 6), d_blocks=(10, 11, 2), num_tokens=40)
    run_transfer(ps, ds, tid=f"tp{p_tp}{d_tp}", **blocks)
    check_bytes(ps, ds, **blocks)
    for d in ds:  # one completion per writing P rank
        (got,) = [x for x in d.received if x.transfer_id == f"tp{p_tp}{d_tp}"]
        assert got.ok


DEADLINE = ReceiverPolicy(
    timeout_ns=3_000 * MS,
    grace_ns=1_000 * MS,
    write_timeout_ns=1_000 * MS,
    heartbeat_interval_ns=200 * MS,
)
SLACK_S = 5.0  # process start-up is done by then; this bounds polling and one heartbeat


@pytest.mark.parametrize("how", ["killed", "unplugged"])
def test_prefill_host_lost_while_decode_waits(
    bed: NetBed, ranks: Callable[..., RankProcess], how: str
) -> None:
    """P's host goes away after D registered: its process killed and namespace removed, or
    its link cut with P alive. D ends the transfer as failed by the latest moment a WRITE of
    P's could still land (deadline + write timeout + grace: docs/protocol.md, no late WRITE)."""
    p_host, d_host = bed.hosts
    p = ranks("P", "prefill", p_host)
    d = ranks("D", "decode", d_host, recv_policy=DEADLINE)
    d.submit(expected_event("lost-p", [p.spec], d.spec, (1, 2), 32))
    p.wait("registration", lambda r: r.counters().transfers >= 1, timeout_s=10)
    t0 = time.monotonic()
    if how == "killed":
        p.kill()
        bed.remove(p_host)
    else:
        bed.cut(p_host)
    bound = (DEADLINE.timeout_ns + DEADLINE.write_timeout_ns + DEADLINE.grace_ns) / 1e9 + SLACK_S
    d.wait(
        "a definite outcome", lambda r: any(x.transfer_id == "lost-p" for x in r.received), bound
    )
    waited = time.monotonic() - t0
    print(f"P's host {how}: D's outcome {waited:.2f}s later")
    (got,) = d.received
    assert not got.ok, got
    assert waited <= bound, (
        f"D took {waited:.1f}s (deadline + write timeout + grace + slack = {bound:.1f}s)"
    )
