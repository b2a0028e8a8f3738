"""A rank's KV geometry in a user's terms: layers, heads, head size, dtype, bytes per token.

Owns: ``KVGeometry`` and ``kv_geometry`` (derived once per ``KVLayout``), which the P-side
transfer spans carry so a trace says why one model's transfers move more bytes than
another's. Pure: reads the layout only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from connector.core.layout import KVLayout

# Bytes of one element by ``KVLayout.dtype``. A name not here (e.g. vLLM's "fp8_ds_mla",
# whose tokens carry scales beside the values) leaves the head size unknown.
ELEMENT_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True)
class KVGeometry:
    """One rank's KV, per token."""

    layers: int
    form: Literal["heads", "latent"]  # K and V per head, or MLA's one latent vector
    heads: int  # KV heads this rank holds (the latent counts as one)
    head_size: int | None  # elements of K (= of V) per head; the latent's width; None: unknown
    dtype: str  # "" from a layout that does not name it
    bytes_per_token: int  # every layer, K and V, this rank's heads
    block_tokens: int


def kv_geometry(layout: KVLayout, latent: bool = False) -> KVGeometry:
    """The geometry ``layout`` describes; ``latent``: its one head is MLA's latent KV (the
    layout alone cannot tell it from a single K|V head)."""
    layers = len({r.layer for r in layout.regions})
    parts = len(layout.regions) // layers if layers else 0
    # a layer's parts (packed K|V in one region, or a K and a V region) hold K and V
    # together; MLA's one part is the latent alone
    entry = ELEMENT_BYTES.get(layout.dtype)
    if entry is None:
        head_size = None
    elif latent:
        head_size = layout.token_bytes // entry
    else:
        head_size = layout.token_bytes * parts // (2 * entry)
    return KVGeometry(
        layers=layers,
        form="latent" if latent else "heads",
        heads=layout.num_heads,
        head_size=head_size,
        dtype=layout.dtype,
        bytes_per_token=len(layout.regions) * layout.num_heads * layout.token_bytes,
        block_tokens=layout.block_size,
    )
