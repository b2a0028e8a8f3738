"""The ``wsum64`` digest (``connector.transfer.wsum``) on CPU torch: equal to its definition
in plain Python, the same for any cut of one stream into runs placed anywhere, changed by a
flipped byte or two swapped words; and ``connector.transfer.integrity`` choosing, computing
and refusing algorithms with a reason. On a CUDA machine the device sum equals the host's."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from connector.core import events as ev
from connector.core import messages as m
from connector.core.digest_ranges import dest_runs
from connector.core.layout import KVLayout
from connector.core.plan import plan_transfer
from connector.tools.loopback import RankSpec
from connector.transfer import integrity, wsum
from connector.transfer.integrity import Check, algo_for, digest_runs, verdict


def _place(stream: bytes, cuts: list[int], gaps: list[int], order: list[int]) -> tuple:
    """``stream`` cut at ``cuts``, its pieces laid out in a buffer in ``order`` with ``gaps``
    bytes of noise between them: the runs (in stream order) and the buffer (keep it alive)."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(stream))), len(stream)]
    pieces = [stream[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    buf = np.full(len(stream) + max(gaps) * len(pieces) + 64, 0xA5, dtype=np.uint8)
    at, addr = 0, [0] * len(pieces)
    for n, i in enumerate(sorted(range(len(pieces)), key=lambda i: order[i % len(order)])):
        at += gaps[n % len(gaps)]
        addr[i] = buf.ctypes.data + at
        buf[at : at + len(pieces[i])] = np.frombuffer(pieces[i], dtype=np.uint8)
        at += len(pieces[i])
    runs = (np.array(addr, dtype=np.int64), np.array([len(p) for p in pieces], dtype=np.int64))
    return runs, buf


def _whole(stream: bytes) -> tuple:
    buf = np.frombuffer(stream, dtype=np.uint8).copy()
    return (np.array([buf.ctypes.data]), np.array([buf.size])), buf


def _mix(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def test_the_reference_is_the_definition_in_its_docstring() -> None:
    """Pure Python integers: a port to another language (a fused kernel) is checked here."""
    rng = np.random.default_rng(1)
    ks = [0, 1, 2, 65535, 65536, 65537, 3 * 65536 + 9]
    data = rng.integers(0, 256, 4 * (ks[-1] + 1) - 1, dtype=np.uint8).tobytes()
    x = np.frombuffer(data + b"\0", dtype="<i4")
    total = 0
    for k in range(x.size):
        c, j = k >> 16, k & 0xFFFF
        t = (2 * j + 1 + (_mix(j) << 17)) % 2**64
        mc = (1 + (c << 17) + (_mix(c ^ wsum.SALT) << 32)) % 2**64
        w = mc * t % 2**64
        if k in ks:
            assert w == int(wsum.weights(np.array([k]))[0])
        total += w * int(x[k])
    assert total % 2**63 == wsum.reference(data)


@given(
    stream=st.binary(min_size=1, max_size=3000),
    cuts=st.lists(st.integers(0, 3000), max_size=12),
    gaps=st.lists(st.integers(0, 17), min_size=1, max_size=5),
    order=st.lists(st.integers(0, 100), min_size=1, max_size=13),
)
def test_any_cut_of_a_stream_placed_anywhere_has_the_same_digest(
    stream: bytes, cuts: list[int], gaps: list[int], order: list[int]
) -> None:
    runs, keep = _place(stream, cuts, gaps, order)
    whole, keep2 = _whole(stream)
    assert wsum.digest_runs(runs, "cpu") == wsum.digest_runs(whole, "cpu")
    assert wsum.digest_runs(runs, "cpu") == wsum.reference(stream)


@given(stream=st.binary(min_size=1, max_size=2000), pos=st.integers(0), bit=st.integers(0, 7))
def test_a_flipped_bit_anywhere_changes_it(stream: bytes, pos: int, bit: int) -> None:
    pos %= len(stream)
    bad = bytearray(stream)
    bad[pos] ^= 1 << bit
    assert wsum.reference(bytes(bad)) != wsum.reference(stream)
    runs, keep = _place(bytes(bad), [pos, pos + 1], [3], [2, 1, 0])
    assert wsum.digest_runs(runs, "cpu") == wsum.reference(bytes(bad))


@given(
    words=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=2, max_size=200, unique=True),
    i=st.integers(0),
    j=st.integers(0),
)
def test_swapping_two_different_words_changes_it(words: list[int], i: int, j: int) -> None:
    i, j = i % len(words), j % len(words)
    if i == j:
        j = (i + 1) % len(words)
    swapped = list(words)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    a = np.array(words, dtype="<i4").tobytes()
    b = np.array(swapped, dtype="<i4").tobytes()
    assert wsum.reference(a) != wsum.reference(b)


def test_the_weights_are_odd_and_distinct_mod_2_32_across_pages() -> None:
    """What the collision argument rests on, checked at page edges up to 2**31 words."""
    edges = (0, 1, wsum.PAGE - 2, wsum.PAGE - 1)
    k = np.array([p * wsum.PAGE + e for p in (0, 1, 2, 7, 1000, 2**15 - 1) for e in edges])
    w = wsum.weights(k)
    assert np.all(w % np.uint64(2) == 1)
    assert np.unique(w % np.uint64(2**32)).size == k.size
    one_page = wsum.weights(np.arange(wsum.PAGE) + 5 * wsum.PAGE)
    assert np.unique(one_page % np.uint64(2**32)).size == wsum.PAGE


@pytest.mark.parametrize("unit_bytes", [1, 4, 256, 4096])
def test_chunked_gathers_over_many_pages_equal_the_definition(
    monkeypatch: pytest.MonkeyPatch, unit_bytes: int
) -> None:
    """Several gathers (chunks and their row bounds made small), several pages, a tail of
    less than a word, and rows of 1 byte to 4 KiB: the sum does not depend on the chunking."""
    monkeypatch.setattr(wsum, "CHUNK_BYTES", 4 * wsum.PAGE)  # one page per gather
    monkeypatch.setattr(wsum, "MAX_ROWS", 1 << 10)
    rng = np.random.default_rng(unit_bytes)
    stream = rng.integers(0, 256, 3 * 4 * wsum.PAGE + 4096 * 3 + (unit_bytes == 1), np.uint8)
    stream = stream[: stream.size // unit_bytes * unit_bytes].tobytes()
    cuts = sorted(rng.choice(len(stream) // unit_bytes, 40, replace=False) * unit_bytes)
    runs, keep = _place(stream, [int(c) for c in cuts], [0, 2 * unit_bytes], [3, 1, 2])
    assert wsum.digest_runs(runs, "cpu") == wsum.reference(stream)


def test_the_fused_product_cuda_takes_equals_the_widened_one_cpu_takes() -> None:
    g = torch.Generator().manual_seed(3)
    words = torch.randint(-(2**31), 2**31 - 1, (3, wsum.PAGE), dtype=torch.int32, generator=g)
    page = wsum._tables(torch.device("cpu")).page
    fused = wsum.page_sums(words, page, fused=True)
    assert torch.equal(fused, wsum.page_sums(words, page, fused=False))
    assert torch.equal(
        wsum.page_sums(words[:, :77], page, fused=True)[:1],
        wsum.page_sums(words[:1, :77], page, fused=False),
    )


def test_empty_runs_are_no_bytes() -> None:
    runs, keep = _whole(b"abcdefg")
    with_empty = (np.concatenate([runs[0], runs[0]]), np.array([7, 0]))
    assert wsum.digest_runs(with_empty, "cpu") == wsum.reference(b"abcdefg")
    assert wsum.digest_runs((np.array([], np.int64), np.array([], np.int64)), "cpu") == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_device_sum_equals_the_host_sum() -> None:
    host = torch.randint(0, 256, (5 * 4 * wsum.PAGE + 13,), dtype=torch.uint8)
    dev = host.cuda()

    def runs(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        return np.array([t.data_ptr() + 7, t.data_ptr() + 1000]), np.array([900, 4 * 5 * wsum.PAGE])

    assert wsum.digest_runs(runs(dev), "cuda") == wsum.digest_runs(runs(host), "cpu")


# ------------------------------------------------------------------ algorithms
def test_p_uses_crc32_between_host_memories_and_wsum64_where_gpu_memory_is() -> None:
    assert algo_for("DRAM", "DRAM") == "crc32"
    assert (
        algo_for("VRAM", "VRAM") == algo_for("DRAM", "VRAM") == algo_for("VRAM", "DRAM") == "wsum64"
    )


def _d() -> tuple[KVLayout, ev.Expected, np.ndarray]:
    spec = RankSpec("D", "D", 0, 1, 1, seed=5)
    buf = spec.allocate()
    return spec.layout(buf), ev.Expected("t", "r", (), ((3, 1),), 0, 20), buf


def test_d_checks_a_wsum64_digest_over_host_memory_and_skips_what_it_cannot_compute() -> None:
    lay, exp, buf = _d()
    heads = lay.heads
    runs = dest_runs(lay, exp.block_ids, first_token=0, num_tokens=20, heads=heads)
    n = int(runs[1].sum())
    good = m.KvDigest(algo="wsum64", value=digest_runs(runs, "wsum64", lay), nbytes=n, heads=heads)
    assert verdict(lay, exp, good) == (Check.OK, "")
    wrong = m.KvDigest(algo="wsum64", value=good.value ^ 1, nbytes=n, heads=heads)
    assert verdict(lay, exp, wrong) == (Check.MISMATCH, "wsum64 differs")
    check, why = verdict(lay, exp, m.KvDigest(algo="xxh3", value=1, nbytes=n, heads=heads))
    assert check is Check.SKIPPED and "xxh3" in why
    # Only the memory kind matters to what D can compute: never read, so no GPU is needed.
    vram = KVLayout(**{**{f: getattr(lay, f) for f in lay.__struct_fields__}, "mem_type": "VRAM"})
    crc = m.KvDigest(algo="crc32", value=1, nbytes=n, heads=heads)
    assert verdict(vram, exp, crc) == (Check.SKIPPED, "crc32 is not computed over GPU memory")
    if not torch.cuda.is_available():
        check, why = verdict(vram, exp, good)
        assert check is Check.SKIPPED and "CUDA is not available" in why


def test_a_d_without_torch_skips_wsum64_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real = builtins.__import__

    def no_torch(name: str, *a: object, **k: object) -> object:
        if name == "torch":
            raise ImportError("no torch")
        return real(name, *a, **k)  # type: ignore[arg-type]

    lay, exp, buf = _d()
    digest = m.KvDigest(algo="wsum64", value=1, nbytes=1, heads=lay.heads)
    monkeypatch.setattr(builtins, "__import__", no_torch)
    assert verdict(lay, exp, digest) == (Check.SKIPPED, "wsum64 needs torch, not installed here")
    assert integrity.cannot_compute("crc32", lay) == ""  # CRC-32 needs no torch


def test_a_device_error_is_no_digest_on_p_and_a_skip_on_d(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither side's transfer thread ends for it, and D fails no load it cannot judge."""
    lay, exp, buf = _d()
    runs = dest_runs(lay, exp.block_ids, first_token=0, num_tokens=20, heads=lay.heads)
    n = int(runs[1].sum())
    digest = m.KvDigest(
        algo="wsum64", value=digest_runs(runs, "wsum64", lay), nbytes=n, heads=lay.heads
    )

    def broken(runs: object, device: object) -> int:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(wsum, "digest_runs", broken)
    check, why = verdict(lay, exp, digest)
    assert check is Check.SKIPPED and "illegal memory access" in why
    pieces = plan_transfer(
        lay, exp.block_ids, lay, exp.block_ids, first_token=0, num_tokens=20, heads=lay.heads
    )
    assert integrity.source_digest(lay, pieces, lay.heads, "VRAM") is None


_KERNEL_CHECK = """
import numpy as np, torch
from connector.transfer import wsum
from tests.unit.transfer.test_wsum import _place
wsum.MAX_ROWS = 1 << 10  # several launches
for unit in (4, 256, 4096):
    rng = np.random.default_rng(unit)
    stream = rng.integers(0, 256, 3 * 4 * wsum.PAGE + 3 * 4096, np.uint8).tobytes()
    cuts = sorted(rng.choice(len(stream) // unit, 40, replace=False) * unit)
    runs, keep = _place(stream, [int(c) for c in cuts], [0, 2 * unit], [3, 1, 2])
    assert wsum._backend(torch.device("cpu"), unit) == "triton"
    assert wsum.digest_runs(runs, "cpu") == wsum.reference(stream), unit
print("ok")
"""


def test_the_triton_kernel_equals_the_definition() -> None:
    """``gpu.wsum_kernel`` under Triton's CPU interpreter (what CUDA runs): several launches,
    several pages, rows of one word to 4 KiB, runs placed out of order with gaps. In a fresh
    interpreter: ``tl.sum``'s own jit functions pick the interpreter when triton is imported."""
    triton = pytest.importorskip("triton")
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip("Triton's interpreter before 3.9 is not what this kernel is checked with")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PUSHKV_WSUM_BACKEND": "triton"}
    done = subprocess.run(
        [sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
