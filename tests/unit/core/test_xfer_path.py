"""The path chooser: every combination of its inputs, and the cost model's monotonicity."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.core.errors import LocalProtocolError
from connector.core.xfer_path import Locality, PathModel, XferPath, choose_path

MIB = 2**20


def pick(descs: int, nbytes: int, **kw: object) -> XferPath:
    args: dict = dict(src_mem="VRAM", dst_mem="VRAM", locality=Locality.REMOTE) | kw
    return choose_path(descs, nbytes, **args).path


def test_contiguous_transfers_stay_direct() -> None:
    # 16k tokens of Llama-8B TP1 merged to 32 descriptors (one per layer): staging only
    # adds bytes, so direct wins wherever IPC is not possible.
    assert pick(32, 2048 * MIB, locality=Locality.REMOTE) is XferPath.DIRECT
    assert pick(32, 2048 * MIB, locality=Locality.SAME_GPU, ipc_ok=False) is XferPath.DIRECT


def test_scattered_vram_goes_ipc_on_one_node_and_staged_across_hosts() -> None:
    assert pick(32_768, 2048 * MIB, locality=Locality.SAME_GPU) is XferPath.IPC
    assert pick(32_768, 2048 * MIB, locality=Locality.SAME_NODE) is XferPath.IPC
    assert pick(32_768, 2048 * MIB, locality=Locality.REMOTE) is XferPath.STAGED
    assert pick(32_768, 2048 * MIB, locality=Locality.SAME_GPU, ipc_ok=False) is XferPath.STAGED


def test_host_memory_and_empty_transfers_are_always_direct() -> None:
    for src, dst in (("DRAM", "VRAM"), ("VRAM", "DRAM"), ("DRAM", "DRAM")):
        c = choose_path(10**6, 10**10, src_mem=src, dst_mem=dst, locality=Locality.SAME_GPU)
        assert c.path is XferPath.DIRECT and c.reason == "host memory"
    assert pick(0, 0, locality=Locality.SAME_GPU) is XferPath.DIRECT


def test_few_descriptors_never_stage() -> None:
    m = PathModel(staged_min_descriptors=256)
    assert pick(255, 10**9, model=m) is XferPath.DIRECT


def test_exhaustive_combinations_respect_the_gates() -> None:
    descs = (0, 1, 100, 256, 8_192, 131_072)
    sizes = (0, 4096, MIB, 512 * MIB)
    mems = ("DRAM", "VRAM")
    for d, n, sm, dm, loc, s_ok, i_ok in itertools.product(
        descs, sizes, mems, mems, Locality, (False, True), (False, True)
    ):
        c = choose_path(d, n, src_mem=sm, dst_mem=dm, locality=loc, staging_ok=s_ok, ipc_ok=i_ok)
        if c.path is XferPath.IPC:
            assert i_ok and loc is not Locality.REMOTE and sm == dm == "VRAM"
        if c.path is XferPath.STAGED:
            assert s_ok and d >= PathModel().staged_min_descriptors and sm == dm == "VRAM"
        assert c.estimates_ns[0][0] is XferPath.DIRECT
        assert {p for p, _ in c.estimates_ns} >= {c.path}


@given(
    d=st.integers(0, 10**6),
    n=st.integers(0, 10**11),
    extra=st.integers(0, 10**6),
    loc=st.sampled_from(Locality),
)
def test_more_descriptors_never_move_a_transfer_back_to_direct(
    d: int, n: int, extra: int, loc: Locality
) -> None:
    first = pick(d, n, locality=loc)
    if first is not XferPath.DIRECT:
        assert pick(d + extra, n, locality=loc) is not XferPath.DIRECT


@given(d=st.integers(0, 10**6), n=st.integers(0, 10**11), gain=st.floats(1.0, 10.0))
def test_chosen_path_beats_direct_by_the_gain(d: int, n: int, gain: float) -> None:
    m = PathModel(min_gain=gain)
    c = choose_path(d, n, src_mem="VRAM", dst_mem="VRAM", locality=Locality.SAME_GPU, model=m)
    est = dict(c.estimates_ns)
    if c.path is not XferPath.DIRECT:
        assert est[c.path] * gain <= est[XferPath.DIRECT]


def test_bad_inputs_raise() -> None:
    with pytest.raises(LocalProtocolError):
        pick(-1, 0)
    with pytest.raises(LocalProtocolError):
        PathModel(min_gain=0.5)
    with pytest.raises(LocalProtocolError):
        PathModel(ipc_gbps=0)
