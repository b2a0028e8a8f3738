"""vLLM's KV cache tensors as pushkv sees them: a ``KVLayout`` for the descriptor planner,
block rows for the GPU paths, and the layout pushkv asks vLLM for.

Owns: ``describe_kv_caches``, ``check_stage_layers`` (a P pipeline stage's layers),
``block_row_views`` and ``preferred_layout``.
vLLM 0.32 hands ``register_kv_caches`` one view per attention layer of logical shape
[B, H, N, C] (blocks, KV heads, tokens, K|V packed per token), whose strides follow the
resolved ``KVCacheLayout`` (``vllm/v1/kv_cache_interface.py``, ``create_kv_cache_views``):
LBHNC gives each layer its own contiguous pages; BLHNC (block-outermost) puts a block's pages
of every layer side by side, so a run of blocks is one run of memory and the planner merges
the layers of a block into one descriptor. Reads tensors' shapes and strides (torch), never
imports vLLM.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from connector.core.errors import LayoutError
from connector.core.layout import KVLayout, Region

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")

# pushkv's wish for vLLM's resolve_kv_cache_layout. On GPUs block-outermost: a block of all
# layers is one page, 1 descriptor per block instead of one per (layer, block)
# (``python -m bench.gpu_push``). vLLM drops a wish the attention backend cannot serve
# (with a warning) and picks the backend's first choice, which describe_kv_caches reads
# just as well. CPU attention serves only LBHNC.
GPU_LAYOUT = "BLHNC"
CPU_LAYOUT = "LBHNC"
# vLLM 0.26 names only NHD and HND (per-layer [B, H, N, 2D] views; FlashAttention raises on
# any other name, CPU attention requires HND): HND is LBHNC there, on GPUs too.
LEGACY_LAYOUT = "HND"


def preferred_layout(device_type: str, named_layouts: bool = True) -> str:
    """The layout to ask vLLM for; ``named_layouts``: vLLM knows LBHNC/BLHNC (0.32+,
    ``vllm_compat.NAMED_LAYOUTS``)."""
    if not named_layouts:
        return LEGACY_LAYOUT
    return GPU_LAYOUT if device_type == "cuda" else CPU_LAYOUT


def kv_dtype_name(cache_dtype: str, tensor_dtype: Any) -> str:
    """The KV element type's name for ``KVLayout.dtype``: ``cache_dtype`` unless it is
    "auto" (the model's dtype) or names the tensors' dtype, else the tensors' dtype
    (``torch.bfloat16`` -> "bfloat16")."""
    if cache_dtype not in ("", "auto"):
        return cache_dtype
    return str(tensor_dtype).removeprefix("torch.")


def as_bhnc(t: Any) -> Any:
    """A layer's KV view as [blocks, heads, tokens, content]: MLA's [blocks, tokens, latent]
    is one head (a view; the addresses are the tensor's)."""
    return t.unsqueeze(1) if t.dim() == 3 else t


def layer_order(kv_caches: dict[str, Any]) -> list[str]:
    """Layer names in model order (``model.layers.10`` after ``model.layers.9``)."""

    def key(name: str) -> tuple[int, str]:
        m = _LAYER_INDEX.search(name)
        return (int(m.group(1)) if m else 1 << 30, name)

    return sorted(kv_caches, key=key)


def check_stage_layers(kv_caches: dict[str, Any], first: int, end: int) -> None:
    """A P pipeline stage's KV: one cache per decoder layer in [first, end), the stage's
    share of the model (vLLM's split). Its regions are then numbered ``first + i``, as a D
    at PP 1 numbers the same layers; LayoutError where a layer holds none or several (their
    numbers would not match D's)."""
    names = layer_order(kv_caches)
    found = [m.group(1) for name in names if (m := _LAYER_INDEX.search(name))]
    if len(names) != end - first or (
        len(found) == len(names) and [int(i) for i in found] != list(range(first, end))
    ):
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise LayoutError(
            f"this pipeline stage runs decoder layers [{first}, {end}) but holds KV caches "
            f"{shown}: pushkv pushes pipeline stages only where every decoder layer holds one "
            "KV cache (run P with --pipeline-parallel-size 1)"
        )


def describe_kv_caches(
    kv_caches: dict[str, Any],
    group_of: dict[str, int],
    heads: tuple[int, int],
    opaque: bool | None = None,
    cache_dtype: str = "auto",
    first_layer: int = 0,
) -> KVLayout:
    """vLLM's per-layer KV views, logically [blocks, heads, tokens, content], as a layout: one
    region per layer, strides read from the tensors (any layout whose content is contiguous:
    LBHNC, LBNHC, BLHNC, BLNHC).

    On CPU the block interior is private to the attention kernel: CPU_ATTN views a head's
    slice as K of every token then V, and its AMX kernels tile them (copying only some of a
    block's tokens corrupts its KV; whole blocks arrive intact). So CPU layouts are
    ``opaque_blocks``: whole blocks of a head move, never token ranges inside one.
    ``opaque`` overrides that (tests of the GPU semantics on CPU tensors).

    ``cache_dtype`` is vLLM's ``--kv-cache-dtype`` (``cache_config.cache_dtype``): the
    layout's ``dtype`` is its name when vLLM quantizes the KV (fp8, fp8_e4m3 and fp8_e5m2
    all live in uint8 tensors), else the tensors' own dtype.

    ``first_layer``: the model's number of the first layer here (a P pipeline stage's
    first decoder layer, ``check_stage_layers``); regions are numbered from it.
    """
    if not kv_caches:
        raise LayoutError("no KV cache tensors to register")
    names = layer_order(kv_caches)
    first = as_bhnc(kv_caches[names[0]])
    cuda = first.device.type == "cuda"
    if first.dim() != 4 or first.stride(3) != 1:
        raise LayoutError(
            f"{names[0]}: KV cache of shape {tuple(first.shape)} strides "
            f"{first.stride()} is not [blocks, heads, tokens, content] (nor MLA's [blocks, "
            "tokens, latent]) with contiguous content"
        )
    num_blocks, num_heads, block_size, content = (int(x) for x in first.shape)
    if num_heads != heads[1] - heads[0]:
        raise LayoutError(f"KV cache holds {num_heads} heads, this rank should hold {heads}")
    elt = first.element_size()
    token_bytes = content * elt
    head_stride, token_stride = first.stride(1) * elt, first.stride(2) * elt
    order: Literal["HND", "NHD"] = "HND" if head_stride >= token_stride else "NHD"
    regions = []
    for i, name in enumerate(names):
        t = as_bhnc(kv_caches[name])
        if (
            t.shape != first.shape
            or t.stride() != first.stride()
            or t.dtype != first.dtype
            or t.device != first.device
        ):
            raise LayoutError(
                f"{name}: KV cache {tuple(t.shape)} {t.dtype} differs from {names[0]}'s "
                f"{tuple(first.shape)} {first.dtype}: pushkv does not push models whose "
                "attention layers differ in KV shape (hybrid or per-layer geometry)"
            )
        regions.append(
            Region(
                layer=first_layer + i,
                group=group_of.get(name, 0),
                part=0,
                base_addr=int(t.data_ptr()),
                block_stride=int(t.stride(0) * elt),
            )
        )
    derived = KVLayout(
        block_size=block_size,
        num_blocks=num_blocks,
        heads=heads,
        token_bytes=token_bytes,
        order=order,
        regions=tuple(regions),
        device_id=int(first.device.index or 0) if cuda else 0,
        mem_type="VRAM" if cuda else "DRAM",
        opaque_blocks=not cuda if opaque is None else opaque,
        dtype=kv_dtype_name(cache_dtype, first.dtype),
    )
    # Strides the order implies travel as 0 (the common case, a smaller registration); a
    # singleton dim's stride means nothing (vLLM canonicalises it), so it takes the default.
    hs, ts = derived.strides()
    layout = msgspec.structs.replace(
        derived,
        head_stride=0 if head_stride == hs or num_heads == 1 else head_stride,
        token_stride=0 if token_stride == ts or block_size == 1 else token_stride,
    )
    layout.validate()
    return layout


def physical_order(kv_caches: dict[str, Any]) -> str:
    """The KV's dims outermost first, as a name: B(locks), L(ayers), H(eads), N (tokens),
    C(ontent); e.g. LBHNC (a page per layer and block) or BLNHC (a block of every layer is
    one page). L goes where the distance between two layers' bases falls among the first
    layer's strides. For the start-up log and the GPU checks (bench/gpu_serve_check.py)."""
    names = layer_order(kv_caches)
    first = as_bhnc(kv_caches[names[0]])
    strides = {"B": first.stride(0), "H": first.stride(1), "N": first.stride(2)}
    if len(names) > 1:
        gap = abs(kv_caches[names[1]].data_ptr() - first.data_ptr()) // first.element_size()
        # separately allocated layers lie farther apart than a whole layer: outermost
        strides["L"] = gap if gap < first.stride(0) * first.shape[0] else 1 << 62
    return "".join(sorted(strides, key=lambda d: -strides[d])) + "C"


def block_row_views(kv_caches: dict[str, Any]) -> list[Any]:
    """Each layer's cache as [num_blocks, row_bytes] uint8 rows, in model order, for the GPU
    paths (``connector.transfer.gpu.rows.RowTable``). A block's [H, N, C] must be one
    contiguous run in some dim order; LayoutError otherwise."""
    from connector.transfer.gpu.rows import block_rows

    out = []
    for name in layer_order(kv_caches):
        t = as_bhnc(kv_caches[name])
        inner = sorted(range(1, t.dim()), key=lambda d: -t.stride(d))  # physical order
        out.append(block_rows(t.permute(0, *inner)))
    return out
