"""The transfer path on KV laid out as vLLM's attention backends hand it over (every
KVCacheLayout the worker reads, bf16 and fp8), between two processes over real NIXL.

On CPU (CI) the bytes go direct. On a GPU (``python -m pytest tests/integration/
test_vllm_kv_push.py`` on the H200) P and D share it: the IPC path and direct descriptors
each move a scattered request, P's "forward" writes the KV on its stream after a device
sleep, and the checksums show both that every byte moved and that P read the KV only after
the step's CUDA event fired (an early read would carry the previous bytes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from connector.core import events as ev
from connector.tools.loopback import RankProcess, RankSpec, expected_event
from connector.tools.stack import free_port
from pushkv_testing.worker_ranks import WorkerRank

pytestmark = [pytest.mark.nixl]

CUDA = torch.cuda.is_available()
SHAPE = dict(num_layers=4, num_blocks=96, block_size=16, num_kv_heads=4, token_bytes=2 * 64 * 2)


@pytest.fixture
def started() -> Iterator[list[RankProcess]]:
    """Every rank process a test starts; all stopped by PID at teardown."""
    procs: list[RankProcess] = []
    yield procs
    for proc in procs:
        proc.stop()
    assert not any(p.proc.is_alive() for p in procs)


def two_ranks(
    started: list[RankProcess],
    kind: type[RankProcess],
    device: str,
    d_block_size: int = 16,
    **kw: object,
) -> tuple[Any, Any]:
    """A P rank and a D rank of ``kind`` (loopback ranks, or the worker role)."""
    shape = {**SHAPE, **kw}
    p = kind(RankSpec("P", "prefill", 0, 1, free_port(), device=device, **shape))  # type: ignore[arg-type]
    started.append(p)
    shape["block_size"] = d_block_size
    d = kind(RankSpec("D", "decode", 0, 1, free_port(), device=device, **shape))  # type: ignore[arg-type]
    started.append(d)
    return p, d


@pytest.fixture
def pair(started: list[RankProcess]) -> Callable[..., tuple[RankProcess, RankProcess]]:
    return functools.partial(two_ranks, started, RankProcess)


@pytest.fixture
def workers(started: list[RankProcess]) -> Callable[..., tuple[WorkerRank, WorkerRank]]:
    return functools.partial(two_ranks, started, WorkerRank)


def push(
    p: RankProcess, d: RankProcess, tid: str, n: int, d_blocks: tuple[int, ...], seed: int
) -> tuple[object, object]:
    nb = -(-n // p.spec.block_size)
    p_blocks = tuple(range(10, 10 + nb))
    d.submit(expected_event(tid, [p.spec], d.spec, d_blocks, n))
    # ~20 ms of device sleep before the KV is written: long enough that a WRITE or copy not
    # waiting for the step's event would read the old bytes.
    p.prefill(ev.PrefillDone(tid, f"req-{tid}", (p_blocks,), n), seed, sleep_cycles=40_000_000)
    d.wait(tid, lambda r: any(x.transfer_id == tid for x in r.received), 60)
    p.wait(tid, lambda r: f"req-{tid}" in r.sent, 60)
    got = next(x for x in d.received if x.transfer_id == tid)
    report = next(r for r in p.reports if r.transfer_id == tid)
    assert got.ok and report.ok, f"{tid}: {got} {report}"
    full, d_full = n // p.spec.block_size, n // d.spec.block_size  # blocks the prompt fills
    ps, ds = p.block_sums(list(p_blocks[:full])), d.block_sums(list(d_blocks[:d_full]))
    if full != d_full:  # other block sizes: each layer's total
        ps, ds = ps.sum(axis=1), ds.sum(axis=1)
    assert (ps == ds).all(), f"{tid}: moved blocks differ (path {report.path})"
    return got, report


@pytest.mark.parametrize(
    ("kv_layout", "dtype"),
    [("LBHNC", "bfloat16"), ("BLHNC", "float8_e4m3fn"), ("LBNHC", "bfloat16")],
)
def test_cpu_vllm_layouts_push_every_byte(pair, kv_layout: str, dtype: str) -> None:
    p, d = pair("cpu", kv_layout=kv_layout, dtype=dtype)
    _, report = push(p, d, "t1", 5 * 16, (50, 3, 77, 21, 8), seed=7)
    assert report.path == "direct"  # host memory: IPC is for GPUs


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("kv_layout", "dtype", "paths", "want"),
    [
        ("LBHNC", "bfloat16", "ipc", "ipc"),
        ("BLHNC", "bfloat16", "ipc", "ipc"),
        ("BLHNC", "float8_e4m3fn", "auto", None),
        ("LBHNC", "bfloat16", "direct", "direct"),
        ("BLNHC", "bfloat16", "ipc", "ipc"),
    ],
)
def test_gpu_paths_push_every_byte_after_the_forward(
    pair, kv_layout: str, dtype: str, paths: str, want: str | None
) -> None:
    p, d = pair("cuda:0", kv_layout=kv_layout, dtype=dtype, xfer_paths=paths)
    for i, n in enumerate((16 * 16, 40 * 16 + 5)):
        d_blocks = tuple(90 - 2 * k for k in range(-(-n // 16)))  # scattered, descending
        _, report = push(p, d, f"t{i}", n, d_blocks, seed=100 + i)
        if want is not None:
            assert report.path == want, report.path_reason
        if report.path == "ipc":
            assert report.descriptors == 0 and report.stage_ms.get("copy", -1) >= 0


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_layout", ["BLHNC", "BLNHC"])
@pytest.mark.parametrize("d_block_size", [32, 8])
def test_gpu_ipc_between_block_sizes(pair, kv_layout: str, d_block_size: int) -> None:
    p, d = pair("cuda:0", d_block_size=d_block_size, kv_layout=kv_layout, xfer_paths="auto")
    n = 16 * 16  # whole blocks on both sides
    d_blocks = tuple(range(95, 95 - 2 * (n // d_block_size), -2))  # scattered
    _, report = push(p, d, "bs", n, d_blocks, seed=11)
    assert report.path == "ipc", report.path_reason


@pytest.mark.parametrize(
    ("device", "kv_layout", "paths"),
    [
        ("cpu", "LBHNC", "auto"),
        pytest.param("cuda:0", "BLHNC", "auto", marks=pytest.mark.skipif(not CUDA, reason="GPU")),
        pytest.param("cuda:0", "LBHNC", "direct", marks=pytest.mark.skipif(not CUDA, reason="GPU")),
    ],
)
def test_worker_sides_push_every_byte_after_the_forward(
    workers, device: str, kv_layout: str, paths: str
) -> None:
    """The plugin's worker role itself (WorkerSide: KV description, path driver, transfer
    thread, the step's CUDA event from after_forward) on both sides."""
    p, d = workers(device, kv_layout=kv_layout, xfer_paths=paths)
    for i, n in enumerate((16 * 16, 24 * 16)):
        tid = f"w{i}"
        p_blocks = tuple(range(5, 5 + n // 16))
        d_blocks = tuple(94 - 3 * k for k in range(n // 16))
        d.register(tid, d_blocks, n, p.decode_leg(tid))
        p.prefill_step(tid, p_blocks, n, seed=300 + i, sleep_cycles=40_000_000)
        d.wait(tid, lambda r, t=tid: f"d-{t}" in r.received, 60)
        p.wait(tid, lambda r, t=tid: f"p-{t}" in r.sent, 60)
        assert f"d-{tid}" not in d.failed, f"{tid} failed on D"
        ps, ds = p.block_sums(list(p_blocks)), d.block_sums(list(d_blocks))
        assert (ps == ds).all(), f"{tid}: moved blocks differ"
    path_counts = {k: v for k, v in p.call("counters")[0].items() if k.startswith("path_")}
    want = "path_ipc" if device != "cpu" and paths != "direct" else "path_direct"
    assert path_counts == {want: 2}, path_counts


@pytest.mark.parametrize(
    ("device", "kv_layout"),
    [
        ("cpu", "LBHNC"),
        pytest.param("cuda:0", "BLHNC", marks=pytest.mark.skipif(not CUDA, reason="GPU")),
    ],
)
def test_a_tp2_prefill_fills_a_tp1_decode(device: str, kv_layout: str) -> None:
    """Each P rank writes its half of the heads into D's blocks (on a GPU through IPC, each
    rank copying its heads' bytes of every block row)."""
    shape = {**SHAPE, "kv_layout": kv_layout, "xfer_paths": "auto", "device": device}
    ps = [RankProcess(RankSpec("P", "prefill", r, 2, free_port(), seed=r, **shape)) for r in (0, 1)]  # type: ignore[arg-type]
    d = RankProcess(RankSpec("D", "decode", 0, 1, free_port(), p_tp=2, **shape))  # type: ignore[arg-type]
    try:
        n, p_blocks, d_blocks = 20 * 16, tuple(range(3, 23)), tuple(range(90, 50, -2))
        d.submit(expected_event("tp", [p.spec for p in ps], d.spec, d_blocks, n))
        for p in ps:
            p.submit(ev.PrefillDone("tp", f"req-tp-{p.spec.rank}", (p_blocks,), n))
        d.wait("tp", lambda r: any(x.transfer_id == "tp" and x.ok for x in r.received), 60)
        for p in ps:
            p.wait("tp", lambda r, p=p: f"req-tp-{p.spec.rank}" in r.sent, 60)
            (report,) = [r for r in p.reports if r.transfer_id == "tp"]
            assert report.ok and report.path == ("ipc" if device != "cpu" else "direct")
        halves = sum(p.block_sums(list(p_blocks)) for p in ps)
        assert (halves == d.block_sums(list(d_blocks))).all(), "D's blocks are not P's heads"
    finally:
        for proc in (*ps, d):
            proc.stop()
