"""KV integrity (``kv_checksum_every``): P's digest of what it pushes and D's check.

Over real buffers: every P rank's digest matches the D rank's own blocks after the copy,
across TP splits, orders and block sizes, and a byte flipped in one rank's heads fails
that rank's check only. Over the fake transport (``tests/unit/test_endpoints.Pair``): a
flipped byte fails the load with ``checksum_mismatch`` (P's blocks back, D told at once);
D with checks off, or a P that sends no digest, goes on as before.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

from connector.config import parse_config
from connector.core import events as ev
from connector.core import messages as m
from connector.core.digest_ranges import dest_runs
from connector.core.plan import plan_transfer
from connector.tools.loopback import RankSpec
from connector.transfer import integrity
from connector.transfer.integrity import Check, digest_runs, sampled, source_digest, verify
from connector.transfer.topology import Topology
from telemetry.schema import Count
from tests.unit.test_endpoints import Pair

NUM_KV_HEADS = 4


def _copy(pieces) -> None:  # type: ignore[no-untyped-def]
    for s, d, n in zip(
        pieces.src.tolist(), pieces.dst.tolist(), pieces.length.tolist(), strict=True
    ):
        ctypes.memmove(d, s, n)


@pytest.mark.parametrize("d_mem", ["DRAM", "VRAM"])  # D in GPU memory: P sends wsum64
@pytest.mark.parametrize(
    ("p_tp", "d_tp", "p_order", "d_order", "p_bs", "d_bs", "first_token"),
    [
        (1, 1, "HND", "HND", 16, 16, 0),
        (1, 2, "HND", "NHD", 16, 8, 8),  # P writes a head subset into each D rank
        (2, 1, "NHD", "HND", 8, 16, 16),  # two P ranks fill halves of D's blocks
        (4, 2, "HND", "HND", 16, 4, 4),
    ],
)
def test_each_p_ranks_digest_matches_d_and_a_flipped_byte_fails_only_its_writer(
    p_tp: int,
    d_tp: int,
    p_order: str,
    d_order: str,
    p_bs: int,
    d_bs: int,
    first_token: int,
    d_mem: str,
) -> None:
    """With ``d_mem`` VRAM P digests with wsum64 (on CPU torch here: its buffers are host
    memory) and D, whose real buffers are host memory too, checks it there."""

    def spec(role: str, rank: int, tp: int, order: str, bs: int) -> RankSpec:
        return RankSpec(role, role, rank, tp, 1, order=order, block_size=bs, seed=3)  # type: ignore[arg-type]

    ps = [spec("P", r, p_tp, p_order, p_bs) for r in range(p_tp)]
    ds = [spec("D", r, d_tp, d_order, d_bs) for r in range(d_tp)]
    p_bufs, d_bufs = [s.allocate() for s in ps], [s.allocate() for s in ds]
    p_lays = [s.layout(b) for s, b in zip(ps, p_bufs, strict=True)]
    d_lays = [s.layout(b) for s, b in zip(ds, d_bufs, strict=True)]
    topo = Topology(NUM_KV_HEADS, p_tp)
    num_tokens = first_token + 37  # a partial last block on both sides
    p_blocks = ((9, 4, 11, 2, 30, 7, 15, 16, 17, 18),)
    d_blocks = ((5, 1, 12, 6, 20, 3, 40, 8, 9, 10),)
    exp = ev.Expected("t", "r", (), d_blocks, first_token, num_tokens)
    for d in range(d_tp):
        digests = {}
        for p in topo.sources(d, d_tp):
            heads = topo.heads(p, d, d_tp)
            pieces = plan_transfer(
                p_lays[p],
                p_blocks,
                d_lays[d],
                d_blocks,
                first_token=first_token,
                num_tokens=num_tokens,
                heads=heads,
            )
            _copy(pieces)
            digests[p] = source_digest(p_lays[p], pieces, heads, d_mem)
        for digest in digests.values():
            assert digest is not None and digest.nbytes > 0
            assert digest.algo == ("crc32" if d_mem == "DRAM" else "wsum64")
            assert verify(d_lays[d], exp, digest) is Check.OK
        victim = min(digests)
        assert digests[victim] is not None
        addr, _ = dest_runs(
            d_lays[d],
            d_blocks,
            first_token=first_token,
            num_tokens=num_tokens,
            heads=digests[victim].heads,  # type: ignore[union-attr]
        )
        byte = (ctypes.c_ubyte * 1).from_address(int(addr[-1]))
        byte[0] ^= 0x01
        for p, digest in digests.items():
            want = Check.MISMATCH if p == victim else Check.OK
            assert verify(d_lays[d], exp, digest) is want, (d, p)


def test_d_skips_what_it_cannot_check_and_refuses_heads_it_does_not_hold() -> None:
    spec = RankSpec("D", "D", 0, 2, 1)  # heads (0, 2) of 4
    lay = spec.layout(buf := spec.allocate())
    exp = ev.Expected("t", "r", (), ((1, 2),), 0, 20)
    runs = dest_runs(lay, exp.block_ids, first_token=0, num_tokens=20, heads=(0, 2))
    good = m.KvDigest(
        algo="crc32", value=digest_runs(runs), nbytes=int(runs[1].sum()), heads=(0, 2)
    )
    assert verify(lay, exp, good) is Check.OK and buf.any() == 0
    assert verify(lay, exp, None) is Check.SKIPPED
    assert (
        verify(lay, exp, m.KvDigest(algo="xxh3", value=1, nbytes=1, heads=(0, 2))) is Check.SKIPPED
    )
    for bad in (
        m.KvDigest(algo="crc32", value=good.value, nbytes=good.nbytes, heads=(2, 4)),
        m.KvDigest(algo="crc32", value=good.value, nbytes=good.nbytes + 1, heads=(0, 2)),
    ):
        assert verify(lay, exp, bad) is Check.MISMATCH


def test_sampling_is_by_transfer_id() -> None:
    ids = [f"t{i}" for i in range(2000)]
    assert not any(sampled(t, 0) for t in ids) and all(sampled(t, 1) for t in ids)
    hit = [t for t in ids if sampled(t, 10)]
    assert 100 < len(hit) < 300 and hit == [t for t in ids if sampled(t, 10)]


def test_the_knob_is_off_by_default_and_validated() -> None:
    assert parse_config({}).kv_checksum_every == 0
    assert parse_config({"kv_checksum_every": 4}).kv_checksum_every == 4
    with pytest.raises(Exception, match="kv_checksum_every"):
        parse_config({"kv_checksum_every": -1})


# ------------------------------------------------------------------ over the fake transport
def _checked(pair: Pair, p_every: int = 1, d_verify: bool = True) -> Pair:
    pair.sender.notices.checksum_every = p_every  # what PushkvConfig.kv_checksum_every sets
    pair.receiver._verify = d_verify
    return pair


def _flip_before_completion(pair: Pair, block: int) -> list[int]:
    """Flip one byte of D's ``block`` after the WRITE landed, before D reads its `done`."""
    flipped: list[int] = []
    inner = pair.td.get_notifs

    def get_notifs() -> list[tuple[str, bytes]]:
        out = inner()
        if any(isinstance(pair.d_guard.decode(f, a), m.Completion) for a, f in out):
            pair.d_buf[0, block].reshape(-1)[5] ^= 0xFF
            flipped.append(block)
        return out

    pair.td.get_notifs = get_notifs  # type: ignore[method-assign]
    return flipped


@pytest.fixture(params=["crc32", "wsum64"])
def algo(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The algorithm P picks; wsum64 stands in for KV in GPU memory (the same code, read by
    CPU torch here), where the fake transport's buffers are host memory."""
    monkeypatch.setattr(integrity, "algo_for", lambda src_mem, dst_mem: request.param)
    return str(request.param)


def test_a_flipped_byte_fails_the_load_with_its_reason(algo: str) -> None:
    pair = _checked(Pair())
    flipped = _flip_before_completion(pair, 9)
    pair.expect("t", 40, (9, 3, 5))
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1, 2, 3),), 40), pair.now)
    pair.pump()
    assert flipped == [9]
    (got,) = pair.receiver.finished
    assert not got.ok and got.reason is m.FailReason.CHECKSUM_MISMATCH
    assert pair.sender.finished == ["preq"]  # P's blocks back
    assert pair.receiver.counters.of(Count.KV_CHECK, "mismatch") == 1
    assert pair.receiver.counters.of(Count.RECV_FAILED, "checksum_mismatch") == 1


def test_intact_kv_passes_and_checks_off_ignore_the_digest(algo: str) -> None:
    for d_verify in (True, False):
        pair = _checked(Pair(), d_verify=d_verify)
        pair.expect("t", 40, (9, 3, 5))
        pair.sender.on_event(ev.PrefillDone("t", "preq", ((1, 2, 3),), 40), pair.now)
        pair.pump()
        assert [(r.ok, r.reason) for r in pair.receiver.finished] == [(True, None)]
        assert pair.receiver.counters.of(Count.KV_CHECK, "ok") == (1 if d_verify else 0)
        assert pair.sender.counters.of(Count.KV_DIGESTS) == 1
        (posted,) = pair.fabric.posted
        assert algo.encode() in posted.notif  # the algorithm travels with the digest


def test_a_p_without_digests_is_skipped_not_failed() -> None:
    pair = _checked(Pair(), p_every=0)
    _flip_before_completion(pair, 9)
    pair.expect("t", 40, (9, 3, 5))
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1, 2, 3),), 40), pair.now)
    pair.pump()
    assert [(r.ok, r.reason) for r in pair.receiver.finished] == [(True, None)]
    assert pair.receiver.counters.of(Count.KV_CHECK, "skipped") == 1
    (posted,) = pair.fabric.posted
    assert b"digest" not in posted.notif  # the frame an older D reads


def test_cost_per_mib_is_small() -> None:
    """Not a benchmark (``python -m bench.kv_checksum`` is): a bound that catches a digest
    gone quadratic or per-byte on a loaded 2-core machine."""
    buf = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
    base = buf.ctypes.data
    runs = (np.arange(base, base + (8 << 20), 4096, dtype=np.int64), np.full(2048, 4096))
    t0 = time.perf_counter()
    digest_runs(runs)
    assert (time.perf_counter() - t0) / 8 < 0.05  # s per MiB; measured ~1 ms


def test_a_digest_travels_in_the_done_and_its_absence_keeps_the_old_frame() -> None:
    digest = m.KvDigest(algo="crc32", value=(1 << 32) - 1, nbytes=4096, heads=(2, 4))
    done = m.Completion(transfer_id="t", p_rank=1, p_tp_size=2, digest=digest)
    assert m.decode(m.encode(done)) == done
    plain = m.Completion(transfer_id="t", p_rank=1, p_tp_size=2)
    frame = m.encode(plain)
    assert m.decode(frame) == plain and b"digest" not in frame
