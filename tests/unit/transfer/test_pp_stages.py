"""P's pipeline stages pushing into one D on the in-process fake transport: each stage's
Sender holds only its layers (numbered as the model numbers them) and writes them into D's
matching layers; D waits for one completion per (writing TP rank, stage) and reports once.

Bytes are checked: after the transfer, every layer of D's blocks holds what the stage that
owns that layer computed, and D's checksum of each stage's write (``kv_checksum_every`` 1)
is ok. A D that expects another number of stages, or holds other layers than P's model, is
refused by every stage it registers with: D fails the load and nothing is written.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from connector.core import events as ev
from connector.core import messages as m
from connector.core.heads import head_range
from connector.core.stages import source_rank
from connector.tools.loopback import RankSpec
from connector.transfer.integrity import Check
from connector.transfer.peers import Peers
from connector.transfer.receiver import Receiver
from connector.transfer.sender import Sender
from connector.transfer.topology import RankInfo, Topology
from connector.transport.fake import FakeFabric
from telemetry.schema import Count

MS = 1_000_000
HEADS = 4  # RankSpec's num_kv_heads


class Stages:
    """P at TP ``p_tp`` with stages of ``sizes`` layers, and one D at TP 1 with ``d_layers``."""

    def __init__(self, p_tp: int, sizes: list[int], d_layers: int | None = None) -> None:
        self.fabric, self.now = FakeFabric(), 0
        self.p_tp, self.pp, total = p_tp, len(sizes), sum(sizes)
        self.windows = []
        first = 0
        for n in sizes:
            self.windows.append((first, first + n))
            first += n
        self.d_spec = RankSpec("D", "decode", 0, 1, 17000, num_layers=d_layers or total)
        self.d_buf = self.d_spec.allocate()
        self.td = self.fabric.transport(self.d_spec.agent, port=self.d_spec.port)
        d_layout = self.d_spec.layout(self.d_buf)
        self.td.register_memory(d_layout.memory_extents())
        self.receiver = Receiver(
            RankInfo("decode", 0, 1, self.d_spec.addr),
            d_layout,
            Peers(self.td, 50 * MS),
            clock=lambda: self.now,
            verify_checksums=True,
        )
        self.p_bufs: dict[tuple[int, int], np.ndarray] = {}
        self.senders: dict[int, Sender] = {}
        self.addrs: dict[int, m.PeerAddr] = {}
        for stage, (lo, hi) in enumerate(self.windows):
            for p in range(p_tp):
                rank = source_rank(stage, p, p_tp)
                spec = RankSpec(
                    "P", f"prefill.s{stage}", p, p_tp, 16000 + rank, num_layers=hi - lo, seed=stage
                )
                buf = spec.allocate()
                t = self.fabric.transport(spec.agent, port=spec.port)
                own = spec.layout(buf)  # layers 0.. of this stage: the model's lo..
                layout = msgspec.structs.replace(
                    own,
                    regions=tuple(
                        msgspec.structs.replace(r, layer=r.layer + lo) for r in own.regions
                    ),
                )
                t.register_memory(layout.memory_extents())
                me = RankInfo("prefill", p, p_tp, spec.addr, pp_stage=stage, pp_size=self.pp)
                self.senders[rank] = Sender(
                    t,
                    me,
                    layout,
                    Topology(HEADS, p_tp),
                    Peers(t, 50 * MS),
                    checksum_every=1,
                    model_layers=total,
                )
                self.p_bufs[(stage, p)] = buf
                self.addrs[rank] = spec.addr

    def expect(self, tid: str, d_blocks: tuple[int, ...], n: int, p_pp_size: int) -> None:
        ranks = [source_rank(s, p, self.p_tp) for s in range(p_pp_size) for p in range(self.p_tp)]
        sources = tuple(ev.Source(r, self.addrs[r]) for r in ranks)
        self.receiver.on_event(
            ev.Expected(tid, f"d{tid}", sources, (d_blocks,), 0, n, p_pp_size=p_pp_size),
            self.now,
        )

    def prefill(self, tid: str, p_blocks: tuple[int, ...], n: int) -> None:
        for s in self.senders.values():
            s.on_event(ev.PrefillDone(tid, f"p{tid}", (p_blocks,), n), self.now)

    def pump(self, rounds: int = 30) -> None:
        endpoints = [*self.senders.values(), self.receiver]
        for _ in range(rounds):
            self.now += MS
            for e in endpoints:
                t = e._t if isinstance(e, Sender) else self.td
                for agent, frame in t.get_notifs():
                    msg = m.decode(frame)
                    e.on_message(agent, msg, self.now)
            for e in endpoints:
                e.peers.poll(self.now)
                e.poll(self.now)


@pytest.mark.parametrize(("p_tp", "sizes"), [(1, [1, 1]), (1, [2, 3]), (2, [1, 2, 2]), (4, [3, 2])])
def test_each_stage_writes_its_layers_and_d_reports_after_the_last(
    p_tp: int, sizes: list[int]
) -> None:
    run = Stages(p_tp, sizes)
    p_blocks, d_blocks = (4, 5, 6), (9, 2, 7)
    run.expect("t", d_blocks, 40, run.pp)
    run.prefill("t", p_blocks, 40)
    run.pump()
    assert [(r.transfer_id, r.ok) for r in run.receiver.finished] == [("t", True)]
    writers = run.pp * p_tp
    assert run.receiver.counters.of(Count.KV_CHECK, Check.OK.value) == writers
    assert all(s.finished == ["pt"] for s in run.senders.values())
    for stage, (lo, hi) in enumerate(run.windows):
        for p in range(p_tp):
            h0, h1 = head_range(p, p_tp, HEADS)
            src = run.p_bufs[(stage, p)]  # [layer - lo, block, heads of p, tokens, bytes]
            for la in range(lo, hi):
                got = run.d_buf[la][list(d_blocks)][:, h0:h1]
                want = src[la - lo][list(p_blocks)]
                # 40 tokens: the third block's first 8 tokens are the prompt's (CPU blocks
                # move whole: RankSpec's layout is not opaque, so only those 8 land)
                assert np.array_equal(got[:2], want[:2]), (stage, p, la)
                assert np.array_equal(got[2][:, :8], want[2][:, :8]), (stage, p, la)
    untouched = [b for b in range(run.d_spec.num_blocks) if b not in d_blocks]
    assert not run.d_buf[:, untouched].any()


@pytest.mark.parametrize(
    ("d_layers", "expects"),
    [
        # D's leg said nothing of P's stages (remote_pp_size 1): it registers with stage 0
        # only, which refuses (D would decode with stage 1's layers never written).
        (None, 1),
        (5, 2),  # D holds other layers than P's model: every stage refuses
    ],
)
def test_a_d_the_stages_cannot_fill_exactly_is_refused_before_any_write(
    d_layers: int | None, expects: int
) -> None:
    run = Stages(1, [2, 2], d_layers=d_layers)
    run.expect("t", (3,), 16, expects)
    run.prefill("t", (1,), 16)
    run.pump()
    ((r),) = run.receiver.finished
    assert (r.ok, r.reason) == (False, m.FailReason.LAYOUT_MISMATCH)
    assert not run.d_buf.any()
