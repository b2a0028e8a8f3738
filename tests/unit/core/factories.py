"""Small builders shared by the core's unit tests."""

from __future__ import annotations

from typing import Any

from connector.core.layout import KVLayout, Region
from connector.core.messages import PeerAddr, Register

LAYOUT = KVLayout(
    block_size=16,
    num_blocks=64,
    heads=(0, 2),
    token_bytes=256,
    order="HND",
    regions=(Region(layer=0, group=0, part=0, base_addr=4096, block_stride=8192),),
)


def d_addr(d_rank: int = 0) -> PeerAddr:
    return PeerAddr(agent=f"d-{d_rank}", host="127.0.0.1", port=17000 + d_rank)


def p_addr(p_rank: int = 0) -> PeerAddr:
    return PeerAddr(agent=f"p-{p_rank}", host="127.0.0.1", port=16000 + p_rank)


def register(
    tid: str = "t0",
    d_rank: int = 0,
    d_tp_size: int = 1,
    ttl_ms: int = 10_000,
    blocks: tuple[int, ...] = (1, 2, 3),
    write_timeout_ms: int | None = None,
) -> Register:
    return Register(
        transfer_id=tid,
        d_engine_id="decode",
        d_rank=d_rank,
        d_tp_size=d_tp_size,
        d_addr=d_addr(d_rank),
        layout=LAYOUT,
        block_ids=(blocks,),
        first_token=0,
        num_tokens=16 * len(blocks),
        ttl_ms=ttl_ms,
        write_timeout_ms=write_timeout_ms,
    )


def make_layout(
    keys,
    *,
    block_size,
    num_blocks,
    heads,
    token_bytes,
    order,
    pad=0,
    base=4096,
    gap=0,
    device_id=0,
    kv_split=False,
):
    """Regions laid one after another from `base`, in the given key order. With `kv_split`,
    each layer is one tensor whose heads hold K[N] then V[N] (vLLM's CPU cache): parts 0
    and 1 of a (layer, group) interleave inside the same blocks."""
    if kv_split:
        regions = _kv_split_regions(
            keys, block_size, num_blocks, heads, token_bytes, pad, base, gap
        )
        order = "HND"  # heads hold K[N] then V[N], so heads and tokens have their own strides
        strides = dict(head_stride=2 * block_size * token_bytes, token_stride=token_bytes)
    else:
        stride = (heads[1] - heads[0]) * block_size * token_bytes + pad
        regions, addr = [], base
        for layer, group, part in keys:
            regions.append(
                Region(layer=layer, group=group, part=part, base_addr=addr, block_stride=stride)
            )
            addr += num_blocks * stride + gap
        strides = {}
    return KVLayout(
        block_size=block_size,
        num_blocks=num_blocks,
        heads=heads,
        token_bytes=token_bytes,
        order=order,
        regions=tuple(regions),
        device_id=device_id,
        **strides,
    )


def _kv_split_regions(keys, n, num_blocks, heads, tb, pad, base, gap):
    nh = heads[1] - heads[0]
    stride = nh * 2 * n * tb + pad
    regions, addr = [], base
    for layer, group in sorted({(k[0], k[1]) for k in keys}):
        for part in (0, 1):
            regions.append(
                Region(
                    layer=layer,
                    group=group,
                    part=part,
                    base_addr=addr + part * n * tb,
                    block_stride=stride,
                )
            )
        addr += num_blocks * stride + gap
    return regions


def base_layout(**kw: Any) -> KVLayout:
    """Two layers of a small HND cache; keywords override make_layout's arguments."""
    args = dict(
        keys=[(0, 0, 0), (1, 0, 0)],
        block_size=4,
        num_blocks=8,
        heads=(0, 2),
        token_bytes=4,
        order="HND",
    )
    args.update(kw)
    return make_layout(**args)
