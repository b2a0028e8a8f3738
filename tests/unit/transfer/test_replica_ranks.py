"""P ranks that hold a copy of the KV no D rank reads (MLA's latent on P ranks past 0, GQA
heads on P TP > heads): they write nothing, so nothing will come from D for them, and they
give the prompt's blocks back as soon as the prefill is done.

Before: such a rank held each request's blocks under P's lease (30 s) waiting for a
registration no D rank sends, then expired the transfer (seen on tiny-mla at P TP 2 into D
TP 1: ``send expired=3, blocks_held=51``), so vLLM kept every prompt's blocks that long.
"""

from __future__ import annotations

import pytest

from connector.core import events as ev
from connector.core.heads import head_range
from connector.core.messages import FailReason, PeerAddr
from connector.core.send_state import SendState
from connector.tools.loopback import RankSpec
from connector.transfer.peers import Peers
from connector.transfer.sender import Sender
from connector.transfer.topology import RankInfo, Topology
from connector.transport.fake import FakeFabric

MS = 1_000_000
LEASE_NS = 30_000 * MS  # SenderPolicy's default lease


def _d_tps(heads: int) -> list[int]:
    """D TP sizes vLLM can split ``heads`` over (head_range's rule), up to 16."""
    out = []
    for d_tp in range(1, 17):
        try:
            head_range(0, d_tp, heads)
        except Exception:
            continue
        out.append(d_tp)
    return out


@pytest.mark.parametrize("heads", [1, 2, 4, 8])
@pytest.mark.parametrize("p_tp", [1, 2, 4, 8])
def test_a_p_rank_writes_for_one_d_tp_size_iff_for_every_one(heads: int, p_tp: int) -> None:
    topo = Topology(heads, p_tp)
    for p in range(p_tp):
        for d_tp in _d_tps(heads):
            assert topo.writes_any(p) == bool(topo.targets(p, d_tp)), (heads, p_tp, p, d_tp)
    # the lowest holder of each head writes; its replicas do not
    assert [topo.writes_any(p) for p in range(p_tp)] == [
        p == 0 or head_range(p, p_tp, heads) != head_range(p - 1, p_tp, heads) for p in range(p_tp)
    ]


def _sender(rank: int, p_tp: int, heads: int) -> Sender:
    fabric = FakeFabric()
    spec = RankSpec("P", "prefill", rank, p_tp, 16000 + rank)
    transport = fabric.transport(spec.agent, port=spec.port)
    layout = spec.layout(spec.allocate())
    transport.register_memory(layout.memory_extents())
    addr = PeerAddr(agent=spec.agent, host="127.0.0.1", port=spec.port)
    return Sender(
        transport,
        RankInfo("prefill", rank, p_tp, addr),
        layout,
        Topology(heads, p_tp),
        Peers(transport, 50 * MS),
    )


def test_an_mla_p_rank_past_0_gives_its_blocks_back_with_the_prefill() -> None:
    idle = _sender(rank=1, p_tp=2, heads=1)  # MLA: one latent "head", replicated
    idle.on_event(ev.PrefillDone("t0", "req-0", ((1, 2, 3),), 48), 0)
    assert idle.finished == ["req-0"]  # vLLM frees the blocks at its next step
    assert idle.table.holding_blocks() == 0
    rec = idle.table.get("t0")
    assert rec is not None and (rec.state, rec.reason) == (SendState.DONE, FailReason.NOT_NEEDED)
    idle.poll(2 * LEASE_NS)  # nothing left to expire
    assert idle.finished == ["req-0"]
    assert not [k for k in idle.table.ended if k[0] is SendState.EXPIRED]


def test_the_rank_that_writes_still_holds_its_blocks_for_d() -> None:
    writer = _sender(rank=0, p_tp=2, heads=1)
    writer.on_event(ev.PrefillDone("t0", "req-0", ((1, 2, 3),), 48), 0)
    assert writer.finished == [] and writer.table.holding_blocks() == 1
