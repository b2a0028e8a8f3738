"""The Sender and Receiver with the GPU path driver, on CPU tensors laid out as vLLM lays them
out (POSIX shared memory stands in for CUDA IPC): D's offer reaches P before its first
registration, P picks a path per target and says why on its report, the IPC copy moves every
byte and D counts its completion; what IPC cannot serve goes direct."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from connector.core import events as ev
from connector.core import messages as m
from connector.core.heads import head_range
from connector.core.plan import plan_transfer
from connector.core.xfer_path import XferPath
from connector.kv_tensors import block_row_views, describe_kv_caches
from connector.transfer.gpu.ipc import IpcPush
from connector.transfer.gpu.lanes import Lane
from connector.transfer.gpu.paths import GpuPaths, IpcWrite, Mode, make_offer
from connector.transfer.gpu.rows import RowTable
from connector.transfer.peers import Peers
from connector.transfer.receiver import Receiver
from connector.transfer.send_records import WriteReport
from connector.transfer.sender import Sender
from connector.transfer.topology import RankInfo, Topology
from connector.transport.fake import FakeFabric

MS = 1_000_000
L, B, H, D = 3, 12, 2, 8
P_ADDR = m.PeerAddr(agent="prefill-0", host="127.0.0.1", port=16000)
D_ADDR = m.PeerAddr(agent="decode-0", host="127.0.0.1", port=17000)


def kv(
    block_size: int, seed: int | None, layout: str = "BLHNC", heads: int = H
) -> tuple[torch.Tensor, dict]:
    from connector.tools.kv_caches import vllm_kv_caches

    raw, views = vllm_kv_caches(L, B, heads, block_size, D, layout=layout)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        raw.copy_(torch.randint(1, 256, raw.shape, dtype=torch.uint8, generator=g))
    return raw, views


class GpuPair:
    """P and D ranks on a fake fabric with vLLM-shaped caches, pumped by hand."""

    def __init__(
        self,
        mode: Mode = "ipc",
        d_block_size: int = 4,
        node: str | None = None,
        layouts: tuple[str, str] = ("BLHNC", "BLHNC"),  # P's and D's vLLM cache layouts
        p_tp: tuple[int, int] = (0, 1),  # (rank, TP size) of P, and of D below
        d_tp: tuple[int, int] = (0, 1),
    ) -> None:
        self.fabric, self.now = FakeFabric(), 0
        self.p_heads, self.d_heads = head_range(*p_tp, H), head_range(*d_tp, H)
        p_h, d_h = self.p_heads[1] - self.p_heads[0], self.d_heads[1] - self.d_heads[0]
        self.p_raw, self.p_views = kv(4, seed=1, layout=layouts[0], heads=p_h)
        self.d_raw, self.d_views = kv(d_block_size, None, layout=layouts[1], heads=d_h)
        # On CPU, sharing moves a storage into shared memory: export before any address is taken.
        offer = make_offer(RowTable.of(block_row_views(self.d_views)), D_ADDR, d_tp[0])
        if node is not None:
            offer = m.IpcOffer(**{**_fields(offer), "node": node})
        # GPU semantics (token ranges inside a block may move)
        p_layout = describe_kv_caches(self.p_views, {}, self.p_heads, opaque=False)
        d_layout = describe_kv_caches(self.d_views, {}, self.d_heads, opaque=False)
        self.tp = self.fabric.transport(P_ADDR.agent, port=P_ADDR.port)
        self.td = self.fabric.transport(D_ADDR.agent, port=D_ADDR.port)
        self.tp.register_memory(p_layout.memory_extents())
        self.td.register_memory(d_layout.memory_extents())
        self.paths = GpuPaths(
            self.tp, p_layout, RowTable.of(block_row_views(self.p_views)), mode=mode
        )
        self.reports: list[WriteReport] = []
        self.sender = Sender(
            self.tp,
            RankInfo("prefill", *p_tp, P_ADDR),
            p_layout,
            Topology(H, p_tp[1]),
            Peers(self.tp, 50 * MS),
            on_write_finished=self.reports.append,
            paths=self.paths,
        )
        self.receiver = Receiver(
            RankInfo("decode", *d_tp, D_ADDR),
            d_layout,
            Peers(self.td, 50 * MS),
            clock=lambda: self.now,
            offer=offer,
        )
        self.seen: list[str] = []  # message types P received

    def transfer(self, tid: str, p_blocks: tuple[int, ...], d_blocks: tuple[int, ...], n: int):
        src = ev.Source(0, P_ADDR)
        self.receiver.on_event(ev.Expected(tid, f"d-{tid}", (src,), (d_blocks,), 0, n), self.now)
        self.sender.on_event(ev.PrefillDone(tid, f"p-{tid}", (p_blocks,), n), self.now)
        self.pump()

    def pump(self) -> None:
        for _ in range(20):
            self.now += MS
            for agent, frame in self.tp.get_notifs():
                msg = m.decode(frame)
                self.seen.append(type(msg).__name__)
                self.sender.on_message(agent, msg, self.now)
            for agent, frame in self.td.get_notifs():
                self.receiver.on_message(agent, m.decode(frame), self.now)
            for peers in (self.sender.peers, self.receiver.peers):
                peers.poll(self.now)
            self.sender.poll(self.now)
            self.receiver.poll(self.now)

    def tokens(self, views: dict, blocks: tuple[int, ...], n: int) -> list[torch.Tensor]:
        """Each layer's first ``n`` tokens through ``blocks``, as bytes."""
        out = []
        for t in views.values():
            rows = t[list(blocks)].view(torch.uint8)  # [blocks, H, N, C]
            per_token = rows.permute(1, 0, 2, 3).reshape(H, -1, rows.shape[-1])
            out.append(per_token[:, :n])
        return out


def _fields(s: Any) -> dict[str, Any]:
    return {f: getattr(s, f) for f in s.__struct_fields__}


def test_ipc_moves_every_byte_and_d_counts_its_completion() -> None:
    pair = GpuPair("ipc")
    pair.transfer("t1", (7, 2, 9), (4, 11, 0), 10)  # scattered, the last block half full
    (got,) = pair.receiver.finished
    assert got.ok
    (report,) = pair.reports
    assert report.ok and report.path == "ipc" and report.descriptors == 0
    assert report.bytes_total > 0 and "copy" in report.stage_ms
    for p, d in zip(
        pair.tokens(pair.p_views, (7, 2, 9), 10),
        pair.tokens(pair.d_views, (4, 11, 0), 10),
        strict=True,
    ):
        assert torch.equal(p, d)
    untouched = [b for b in range(B) if b not in (4, 11, 0)]
    assert int(pair.d_raw.view(B, -1)[untouched].sum()) == 0  # BLHNC: a block is one page
    assert pair.seen == ["IpcOffer", "Register"]  # the offer first, on the same path


def test_ipc_from_one_rank_of_a_wider_p_moves_only_its_heads() -> None:
    pair = GpuPair("ipc", p_tp=(1, 2), d_tp=(0, 1))  # P rank 1 of 2 holds head 1 of 2
    # D waits for this P rank only (the other rank of a TP-2 P is not in this test).
    pair.receiver.on_event(
        ev.Expected("t1", "d-t1", (ev.Source(1, P_ADDR),), ((4, 11),), 0, 8), pair.now
    )
    pair.sender.on_event(ev.PrefillDone("t1", "p-t1", ((7, 2),), 8), pair.now)
    pair.pump()
    assert pair.receiver.finished and pair.receiver.finished[0].ok
    (report,) = pair.reports
    assert report.ok and report.path == "ipc", report.path_reason
    for p_t, d_t in zip(pair.p_views.values(), pair.d_views.values(), strict=True):
        for pb, db in ((7, 4), (2, 11)):
            assert torch.equal(
                d_t[db, 1:].view(torch.uint8), p_t[pb].view(torch.uint8)
            )  # P's bytes
            assert int(d_t[db, :1].view(torch.uint8).sum()) == 0  # the other rank's head


def test_ipc_into_one_rank_of_a_wider_d_takes_the_heads_it_holds() -> None:
    pair = GpuPair("ipc", p_tp=(0, 1), d_tp=(1, 2))  # D rank 1 of 2 holds head 1 of 2
    reg = m.Register(
        transfer_id="t1",
        d_engine_id="decode",
        d_rank=1,
        d_tp_size=2,
        d_addr=D_ADDR,
        layout=pair.receiver.layout,
        block_ids=((4, 11),),
        first_token=0,
        num_tokens=8,
        ttl_ms=1000,
    )
    pair.paths.offered(D_ADDR.agent, pair.receiver._offer)  # type: ignore[arg-type]
    choice = pair.paths.choose(reg, ((7, 2),), (1, 2))
    assert choice.path is XferPath.IPC and choice.bytes_total == 2 * L * 4 * 2 * D * 2
    write = pair.paths.start(choice, reg, ((7, 2),), (1, 2), b"done")
    pair.tp.connect(D_ADDR.agent, *pair.td.listen_address, timeout_s=0)
    assert write.pump() and pair.td.get_notifs() == [(P_ADDR.agent, b"done")]
    for p_t, d_t in zip(pair.p_views.values(), pair.d_views.values(), strict=True):
        for pb, db in ((7, 4), (2, 11)):
            assert torch.equal(d_t[db].view(torch.uint8), p_t[pb, 1:].view(torch.uint8))  # head 1


@pytest.mark.parametrize("layout", ["BLHNC", "LBNHC"])  # head-major, token-major
@pytest.mark.parametrize(
    ("d_block_size", "p_blocks", "d_blocks", "n"),
    [(2, (7, 2, 9), (4, 11, 0, 1, 6, 3), 11), (8, (7, 2, 9, 5), (4, 11), 14)],
)
def test_ipc_between_block_sizes_puts_every_token_in_its_place(
    layout: str, d_block_size: int, p_blocks: tuple, d_blocks: tuple, n: int
) -> None:
    pair = GpuPair("ipc", d_block_size=d_block_size, layouts=(layout, layout))
    pair.transfer("t1", p_blocks, d_blocks, n)
    (report,) = pair.reports
    assert report.ok and report.path == "ipc", report.path_reason
    assert pair.receiver.finished[0].ok
    p_bytes, d_bytes = (
        pair.tokens(pair.p_views, p_blocks, n),
        pair.tokens(pair.d_views, d_blocks, n),
    )
    for p, d in zip(p_bytes, d_bytes, strict=True):
        assert torch.equal(p.view(torch.uint8), d.view(torch.uint8))


def test_the_offer_goes_to_each_p_agent_once() -> None:
    pair = GpuPair("ipc")
    pair.transfer("t1", (1,), (2,), 4)
    pair.transfer("t2", (3,), (5,), 4)
    assert pair.seen == ["IpcOffer", "Register", "Register"]
    assert [r.path for r in pair.reports] == ["ipc", "ipc"]


def test_auto_keeps_host_memory_direct_and_still_moves_the_bytes() -> None:
    pair = GpuPair("auto")
    pair.transfer("t1", (7, 2), (4, 11), 8)
    (report,) = pair.reports
    assert report.ok and report.path == "direct" and "host memory" in report.path_reason
    assert report.descriptors > 0
    assert pair.receiver.finished[0].ok
    p_bytes, d_bytes = pair.tokens(pair.p_views, (7, 2), 8), pair.tokens(pair.d_views, (4, 11), 8)
    for p, d in zip(p_bytes, d_bytes, strict=True):
        assert torch.equal(p, d)


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"layouts": ("BLHNC", "BLNHC")}, "block interiors differ"),
        ({"node": "another-host"}, "no IPC offer taken"),
    ],
)
def test_what_ipc_cannot_serve_goes_direct_with_the_reason(kwargs: dict, why: str) -> None:
    pair = GpuPair("ipc", **kwargs)
    pair.transfer("t1", (7, 2), (4, 11), 8)
    (report,) = pair.reports
    assert report.ok and report.path == XferPath.DIRECT.value
    assert why in report.path_reason
    assert pair.receiver.finished[0].ok
    if "node" in kwargs:
        assert pair.paths.refused[D_ADDR.agent] == "another node"


def test_an_aborted_ipc_copy_finishes_but_sends_no_completion() -> None:
    fabric = FakeFabric()
    tp, td = fabric.transport("prefill"), fabric.transport("decode")
    tp.connect("decode", *td.listen_address, timeout_s=0)
    src = RowTable.of([torch.full((4, 64), 3, dtype=torch.uint8)])
    dst_t = torch.zeros(4, 64, dtype=torch.uint8)
    dst = RowTable.of([dst_t])
    ids = torch.tensor([1, 2], dtype=torch.int64)
    write = IpcWrite(IpcPush(tp, "decode", src, ids, dst, ids, Lane("cpu"), b"done"))
    write.withhold()
    assert write.pump()  # the copy has run: the blocks may be released
    assert td.get_notifs() == []  # but D hears nothing: the transfer already failed
    assert int(dst_t[1:3].sum()) == 2 * 64 * 3


@pytest.mark.parametrize(("layout", "per_run"), [("BLHNC", 1), ("LBHNC", L)])
def test_the_direct_estimate_counts_what_the_planner_posts(layout: str, per_run: int) -> None:
    _, views = kv(4, seed=None, layout=layout)
    lay = describe_kv_caches(views, {}, (0, H), opaque=False)
    paths = GpuPaths(FakeFabric().transport("p"), lay, RowTable.of(block_row_views(views)))
    src, dst = [1, 2, 3, 7, 8], [4, 5, 6, 0, 1]  # two runs consecutive on both sides
    assert paths._direct_descriptors(src, dst) == 2 * per_run
    pieces = plan_transfer(
        lay, (tuple(src),), lay, (tuple(dst),), first_token=0, num_tokens=5 * 4, heads=(0, H)
    )
    assert pieces.count == 2 * per_run


def test_the_mapping_of_a_dead_d_is_released() -> None:
    """An open IPC mapping keeps D's KV allocated: P drops it once D's process is gone."""
    import subprocess
    import sys

    pair = GpuPair("ipc")
    offer = pair.receiver._offer
    assert offer is not None and offer.pid_ns  # Linux: P and D share the pid namespace here
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that existed and is gone
    dead = m.IpcOffer(**{**_fields(offer), "pid": child.pid})
    pair.paths.offered(D_ADDR.agent, dead)
    assert D_ADDR.agent in pair.paths._mapped
    pair.paths.poll(now_ns=10**12)
    assert D_ADDR.agent not in pair.paths._mapped
    pair.paths.offered(D_ADDR.agent, offer)  # this process: alive, kept
    pair.paths.poll(now_ns=10**13)
    assert D_ADDR.agent in pair.paths._mapped


@pytest.mark.parametrize("algo", ["crc32", "wsum64"])
def test_an_ipc_write_carries_a_digest_that_d_checks_and_a_flipped_byte_fails(
    monkeypatch: pytest.MonkeyPatch, algo: str
) -> None:
    """kv_checksum_every on the IPC path: P digests its source bytes in D's order (planned
    for the digest only), D checks its blocks when the done arrives. On CPU the caches are
    host memory; wsum64 (what GPU memory gets) is forced to run the same code here."""
    from connector.transfer import integrity
    from telemetry.schema import Count

    monkeypatch.setattr(integrity, "algo_for", lambda src_mem, dst_mem: algo)
    for flip in (False, True):
        pair = GpuPair("ipc")
        pair.sender.notices.checksum_every, pair.receiver._verify = 1, True  # kv_checksum_every: 1
        inner = pair.td.get_notifs

        def get_notifs(
            pair: GpuPair = pair, inner: Any = inner, flip: bool = flip
        ) -> list[tuple[str, bytes]]:
            out = inner()
            if flip and any(isinstance(m.decode(f), m.Completion) for _, f in out):
                pair.d_raw.view(B, -1)[11, 3] ^= 0xFF  # a byte of a block P wrote
            return out

        pair.td.get_notifs = get_notifs  # type: ignore[method-assign]
        pair.transfer("t1", (7, 2, 9), (4, 11, 0), 10)
        (report,) = pair.reports
        assert report.path == "ipc" and pair.sender.counters.of(Count.KV_DIGESTS) == 1
        (got,) = pair.receiver.finished
        if flip:
            assert not got.ok and got.reason is m.FailReason.CHECKSUM_MISMATCH
            assert pair.receiver.counters.of(Count.KV_CHECK, "mismatch") == 1
        else:
            assert got.ok and pair.receiver.counters.of(Count.KV_CHECK, "ok") == 1


@pytest.mark.parametrize("mode", ["ipc", "auto", "direct"])
def test_the_copy_kernel_is_compiled_at_start_up_on_ps_own_block_0(
    mode: Mode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not on the first request's WRITE; a no-op on P's KV, and nothing where no copy runs."""
    from connector.transfer.gpu import paths as paths_mod

    calls: list[tuple[Any, ...]] = []
    real = paths_mod.copy_rows

    def spy(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        real(*args, **kwargs)

    monkeypatch.setattr(paths_mod, "copy_rows", spy)
    pair = GpuPair(mode)
    before = pair.p_raw.clone()
    paths = GpuPaths(pair.tp, pair.paths.layout, pair.paths.rows, mode=mode)
    assert torch.equal(pair.p_raw, before)
    if mode == "direct":
        assert calls == []
        return
    (src, src_ids, dst, dst_ids) = calls[-1]
    assert src is dst is paths.rows
    assert src_ids.tolist() == dst_ids.tolist() == [0]
