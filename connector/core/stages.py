"""Pipeline parallelism on P: which worker of P is which source, and what a stage writes.

Owns: ``PipelineStage`` (a worker's stage and layers), ``source_rank`` (a P worker's
identity as a source of KV: its rank among the engine's workers, vLLM's numbering,
stage-major), ``source_ranks`` (the sources a D rank waits for: one per writing TP rank per
stage) and ``stage_view`` (the part of D's KV one stage writes, after checking that D's
layers are exactly P's model's and that the stage's own regions are all of D's for its
layers). Pure: imports ``connector.core`` only.

Why the checks. A P stage holds only its layers ([first, end) of the model, numbered as the
whole model numbers them) and writes only those; D at PP 1 holds every layer and waits for
one completion per stage. If D held a layer no stage writes (another model, or a D that
expects fewer stages than P runs), a completion from every stage would still leave that
layer's blocks unwritten and D would decode garbage. So each stage refuses to write unless
D's layers are exactly ``range(total_layers)`` and D's regions of the stage's layers are
exactly the stage's regions; together with vLLM's split (the stages' layers partition the
model's), every D region is written by exactly one stage. A D that waits for another number
of stages than P runs (``Register.p_pp_size``) is refused by every stage it registers with.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from connector.core.errors import LayoutError
from connector.core.layout import KVLayout


@dataclass(frozen=True)
class PipelineStage:
    """A P worker's pipeline stage: ``stage`` of ``size``, holding the model's decoder
    layers [``first_layer``, ``end_layer``) of ``model_layers``."""

    stage: int = 0
    size: int = 1
    first_layer: int = 0
    end_layer: int = 0
    model_layers: int = 0


def source_rank(pp_stage: int, tp_rank: int, tp_size: int) -> int:
    """The worker of P's pipeline stage ``pp_stage`` and TP rank ``tp_rank``, as a source:
    vLLM's rank of that worker in its engine (stage-major); the TP rank at PP 1."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size or pp_stage < 0:
        raise LayoutError(f"bad P worker: stage {pp_stage}, TP rank {tp_rank} of {tp_size}")
    return pp_stage * tp_size + tp_rank


def source_ranks(tp_sources: Iterable[int], tp_size: int, pp_size: int) -> tuple[int, ...]:
    """The sources a D rank waits for: each P TP rank in ``tp_sources`` (those that write
    its heads) in each of P's ``pp_size`` stages."""
    if pp_size < 1:
        raise LayoutError(f"bad P pipeline size {pp_size}")
    tps = tuple(tp_sources)
    return tuple(source_rank(s, p, tp_size) for s in range(pp_size) for p in tps)


def layers_of(layout: KVLayout) -> frozenset[int]:
    """The layers a layout holds regions of."""
    return frozenset(r.layer for r in layout.regions)


def layer_span(layout: KVLayout) -> tuple[int, int]:
    """A stage's layers as [first, end); LayoutError unless they are contiguous."""
    layers = sorted(layers_of(layout))
    if not layers or layers[-1] - layers[0] + 1 != len(layers):
        raise LayoutError(f"a pipeline stage's layers are not one contiguous run: {layers}")
    return layers[0], layers[-1] + 1


def layers_view(layout: KVLayout, layers: tuple[int, int]) -> KVLayout:
    """``layout`` with only the regions of layers [first, end) (D: what one stage wrote)."""
    lo, hi = layers
    regions = tuple(r for r in layout.regions if lo <= r.layer < hi)
    if not regions:
        raise LayoutError(f"no KV regions in layers [{lo}, {hi})")
    return msgspec.structs.replace(layout, regions=regions)


def stage_view(dst: KVLayout, src: KVLayout, total_layers: int) -> KVLayout:
    """D's layout ``dst`` restricted to the layers of P's stage ``src``, once checked that
    D's layers are exactly ``range(total_layers)`` (P's model's) and that D's regions of
    those layers are exactly the stage's; LayoutError saying which check failed."""
    d_layers = layers_of(dst)
    if d_layers != frozenset(range(total_layers)):
        raise LayoutError(
            f"D holds KV of {len(d_layers)} layers ({_span_text(d_layers)}), P's model has "
            f"{total_layers}: not the same model"
        )
    mine = layers_of(src)
    view = tuple(r for r in dst.regions if r.layer in mine)
    src_keys, view_keys = set(src.region_keys()), {r.key for r in view}
    if src_keys != view_keys:
        diff = sorted(src_keys ^ view_keys)
        raise LayoutError(
            f"this pipeline stage's KV regions differ from D's for layers "
            f"{_span_text(mine)}: {diff[:4]}"
        )
    return msgspec.structs.replace(dst, regions=view)


def check_stages(d_expects: int, p_runs: int) -> None:
    """LayoutError unless D waits for as many stages as P runs (``Register.p_pp_size``)."""
    if d_expects != p_runs:
        raise LayoutError(
            f"D waits for {d_expects} pipeline stage(s) of P, P runs {p_runs}: D's leg has "
            "the wrong remote_pp_size (the router learns it from its probe of P; "
            "--prefill-* flags alone give 1)"
        )


def _span_text(layers: frozenset[int]) -> str:
    if not layers:
        return "none"
    lo, hi = min(layers), max(layers)
    return f"{lo}..{hi}" if len(layers) == hi - lo + 1 else ",".join(map(str, sorted(layers)))
