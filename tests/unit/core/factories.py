"""Small builders shared by the core's unit tests."""

from __future__ import annotations

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
    )
