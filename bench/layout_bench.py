"""Timings and descriptor counts of `plan_transfer` for a few realistic shapes.

Run: python -m bench.layout_bench. Owns nothing the connector imports; uses only numpy,
connector.core.layout and (if installed) rich.
"""

import statistics
import time
from dataclasses import dataclass

import numpy as np

from connector.core.heads import head_range
from connector.core.layout import KVLayout, Region
from connector.core.plan import Pieces, plan_transfer

TOKEN_BYTES = 2 * 128 * 2  # packed K|V, head_size 128, bf16
NUM_KV_HEADS = 8


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int = 80
    blocks: int = 1024  # blocks moved, at P's block size
    p_block: int = 16
    d_block: int = 16
    p_order: str = "HND"
    d_order: str = "HND"
    d_tp: int = 1  # D rank 0 of this TP receives; P has TP 1 (all heads)
    scattered: bool = False


SHAPES = [
    Shape("HND same, contiguous ids"),
    Shape("HND same, scattered ids", scattered=True),
    Shape("HND Bs16 -> Bd32, scattered", d_block=32, scattered=True),
    Shape("HND TP1 -> TP2, scattered", d_tp=2, scattered=True),
    Shape("NHD same, contiguous ids", p_order="NHD", d_order="NHD"),
    Shape("NHD same, scattered ids", p_order="NHD", d_order="NHD", scattered=True),
    Shape("NHD TP1 -> TP2, contiguous", p_order="NHD", d_order="NHD", d_tp=2, blocks=256),
    Shape("HND -> NHD, contiguous", d_order="NHD", blocks=64),
]


def layout(
    layers: int, block: int, num_blocks: int, heads: tuple[int, int], order: str, base: int
) -> KVLayout:
    stride = (heads[1] - heads[0]) * block * TOKEN_BYTES
    regions = tuple(
        Region(
            layer=i, group=0, part=0, base_addr=base + i * num_blocks * stride, block_stride=stride
        )
        for i in range(layers)
    )
    return KVLayout(
        block_size=block,
        num_blocks=num_blocks,
        heads=heads,
        token_bytes=TOKEN_BYTES,
        order=order,
        regions=regions,
    )  # type: ignore[arg-type]


def run(shape: Shape, repeats: int = 7) -> tuple[float, float, Pieces]:
    rng = np.random.default_rng(0)
    tokens = shape.blocks * shape.p_block
    d_need = -(-tokens // shape.d_block)
    p_nb, d_nb = 2 * shape.blocks + 8, 2 * d_need + 8
    d_heads = head_range(0, shape.d_tp, NUM_KV_HEADS)
    src = layout(shape.layers, shape.p_block, p_nb, (0, NUM_KV_HEADS), shape.p_order, 1 << 40)
    dst = layout(shape.layers, shape.d_block, d_nb, d_heads, shape.d_order, 1 << 44)
    if shape.scattered:
        sb = [rng.permutation(p_nb)[: shape.blocks].tolist()]
        db = [rng.permutation(d_nb)[:d_need].tolist()]
    else:
        sb, db = [list(range(5, 5 + shape.blocks))], [list(range(5, 5 + d_need))]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pieces = plan_transfer(src, sb, dst, db, first_token=0, num_tokens=tokens, heads=d_heads)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3, pieces


def main() -> None:
    rows = []
    for shape in SHAPES:
        median_ms, best_ms, pieces = run(shape)
        rows.append(
            (
                shape.name,
                f"{shape.layers}x{shape.blocks}",
                f"{median_ms:.2f}",
                f"{best_ms:.2f}",
                f"{pieces.count:,}",
                f"{pieces.bytes_total / 2**20:,.0f}",
            )
        )
    header = ("shape", "regions x blocks", "median ms", "best ms", "pieces", "MiB")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
        return
    table = Table(title="plan_transfer (8 KV heads, 512 B per token-head)")
    for i, col in enumerate(header):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=110).print(table)


if __name__ == "__main__":
    main()
