"""The IPC path on CPU tensors: D's rows exported and mapped again (POSIX shared memory
stands in for CUDA IPC), P's copy straight into them, the notification only after it."""

from __future__ import annotations

import msgspec
import pytest
import torch

from connector.core.errors import LayoutError
from connector.transfer.gpu.ipc import IpcExport, IpcPush, export_rows, import_rows
from connector.transfer.gpu.lanes import Lane
from connector.transfer.gpu.rows import RowTable, block_rows
from connector.transport.fake import FakeFabric

NB, N, H, D = 10, 16, 2, 8


def flashinfer_rows(kvs: list[torch.Tensor]) -> RowTable:
    return RowTable.of([block_rows(kv[:, p]) for kv in kvs for p in (0, 1)])


def test_export_round_trips_through_msgpack_and_maps_the_same_memory() -> None:
    kvs = [torch.zeros(NB, 2, N, H, D, dtype=torch.bfloat16) for _ in range(3)]
    d_rows = flashinfer_rows(kvs)
    export = export_rows(d_rows)  # before any address of d_rows is taken: CPU sharing moves it
    assert len(export.storages) == 3 and len(export.regions) == 6
    wire = msgspec.msgpack.encode(export)
    mapped = import_rows(msgspec.msgpack.decode(wire, type=IpcExport))
    assert [t.stride() for t in mapped.tensors] == [t.stride() for t in d_rows.tensors]
    mapped.tensors[3][7].fill_(9)  # layer 1, V, block 7
    assert bool((kvs[1][7, 1].view(torch.uint8) == 9).all())
    assert int(kvs[1][7, 0].view(torch.uint8).sum()) == 0  # K of the block untouched


def test_ipc_push_moves_every_named_row_then_notifies() -> None:
    fabric = FakeFabric()
    p, d = fabric.transport("prefill"), fabric.transport("decode")
    p.connect("decode", *d.listen_address, timeout_s=0)
    g = torch.Generator().manual_seed(5)
    src = RowTable.of(
        [torch.randint(1, 256, (NB, 512), dtype=torch.uint8, generator=g) for _ in range(4)]
    )
    d_kv = torch.zeros(4, NB, 512, dtype=torch.uint8)
    d_rows = RowTable.of(list(d_kv.unbind(0)))
    mapped = import_rows(export_rows(d_rows))
    s_ids = torch.tensor([9, 0, 4], dtype=torch.int64)
    d_ids = torch.tensor([1, 2, 8], dtype=torch.int64)
    push = IpcPush(p, "decode", src, s_ids, mapped, d_ids, Lane("cpu"), b"ready:t1")
    assert d.get_notifs() == []  # nothing before pump has seen the copy finish
    assert push.pump() and push.pump()
    assert d.get_notifs() == [("prefill", b"ready:t1")]
    for r in range(4):
        assert torch.equal(d_kv[r][d_ids], src.tensors[r][s_ids])
        assert int(d_kv[r][[0, 3, 5, 6, 7, 9]].sum()) == 0
    assert push.device_ms() >= 0


def test_import_refuses_regions_past_their_storage() -> None:
    kv = torch.zeros(4, 64, dtype=torch.uint8)  # alive while mapped: its owner unlinks it
    export = export_rows(RowTable.of([kv]))
    bad = msgspec.structs.replace(
        export, regions=(msgspec.structs.replace(export.regions[0], num_blocks=5),)
    )
    with pytest.raises(LayoutError):
        import_rows(bad)
    with pytest.raises(LayoutError):
        import_rows(msgspec.structs.replace(export, version=2))
