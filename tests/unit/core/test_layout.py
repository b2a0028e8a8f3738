"""Tests of connector/core/layout.py: the wire type's validation and its memory extents."""

import msgspec
import pytest

from connector.core.errors import LayoutError
from connector.core.layout import KVLayout, Region
from tests.unit.core.factories import base_layout


def test_layout_roundtrips_on_the_wire():
    lay = base_layout()
    lay.validate()
    wire = msgspec.msgpack.encode(lay)
    assert msgspec.msgpack.decode(wire, type=KVLayout) == lay
    bad = msgspec.to_builtins(lay) | {"extra": 1}
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(bad, KVLayout)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(msgspec.to_builtins(lay) | {"block_size": 0}, KVLayout)


def with_regions(lay: KVLayout, *regions: Region) -> KVLayout:
    return msgspec.structs.replace(lay, regions=tuple(regions))


def test_validate_errors():
    lay = base_layout()
    r0, r1 = lay.regions
    bb = lay.block_bytes
    cases = [
        with_regions(lay, r0, msgspec.structs.replace(r1, layer=0)),  # duplicate key
        with_regions(lay, r0, msgspec.structs.replace(r1, block_stride=bb - 1)),  # stride small
        msgspec.structs.replace(lay, heads=(2, 2)),  # empty head range
        msgspec.structs.replace(lay, heads=(3, 1)),
        with_regions(lay, r0, msgspec.structs.replace(r1, base_addr=r0.base_addr + bb)),  # overlap
        msgspec.structs.replace(lay, block_size=0),  # Meta constraint, applied by validate()
        with_regions(lay, msgspec.structs.replace(r0, base_addr=2**63 - 8)),
    ]
    for bad in cases:
        with pytest.raises(LayoutError):
            bad.validate()


def test_interleaved_regions_are_allowed_and_registered_once():
    # K and V of a block side by side ([num_blocks, 2, ...]): same stride, disjoint bytes.
    lay = base_layout(keys=[(0, 0, 0)])
    bb, nb = lay.block_bytes, lay.num_blocks
    k = Region(layer=0, group=0, part=0, base_addr=4096, block_stride=2 * bb)
    v = Region(layer=0, group=0, part=1, base_addr=4096 + bb, block_stride=2 * bb)
    inter = with_regions(lay, k, v)
    inter.validate()
    assert inter.memory_extents() == [(4096, 2 * bb * nb)]  # V's span ends at its last byte
    with pytest.raises(LayoutError):  # V shifted into K's data
        with_regions(lay, k, msgspec.structs.replace(v, base_addr=4096 + bb // 2)).validate()


def test_memory_extents_merge_adjacent_and_keep_gaps():
    lay = base_layout(keys=[(0, 0, 0), (1, 0, 0), (2, 0, 0)])
    span = lay.num_blocks * lay.regions[0].block_stride
    assert lay.memory_extents() == [(4096, 3 * span)]
    gapped = base_layout(keys=[(0, 0, 0), (1, 0, 0)], gap=100)
    assert gapped.memory_extents() == [(4096, span), (4096 + span + 100, span)]
    assert lay.region_keys() == ((0, 0, 0), (1, 0, 0), (2, 0, 0))
