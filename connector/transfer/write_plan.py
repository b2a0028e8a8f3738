"""How one transfer's WRITEs go, decided on P before any is posted.

Owns: ``LayoutCheck`` (peer layouts, validated once), ``TargetPlan`` (one D target: its
path and, on the direct path, its descriptors), ``plan_writes`` (every target's plan, or
``LayoutError`` when one cannot be mapped), ``stage_target`` (what a P pipeline stage
writes of D's KV) and ``new_report`` (the report those WRITEs fill in). Posting them is
``connector.transfer.sender``'s job.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from connector.core import events as ev
from connector.core import messages as m
from connector.core.errors import LayoutError
from connector.core.heads import HeadRange
from connector.core.layout import KVLayout, check_same_dtype
from connector.core.plan import Pieces, plan_transfer
from connector.core.stages import check_stages, stage_view
from connector.core.xfer_path import PathChoice, XferPath
from connector.transfer.paths import Paths
from connector.transfer.send_records import WriteReport


class LayoutCheck:
    """A peer's layout, validated once (the planner trusts validated layouts), with our
    KV's element type (every path, not only DIRECT's planner, copies bytes as they are)."""

    def __init__(self, keep: int = 64) -> None:
        self._keep = keep
        self._valid: dict[KVLayout, None] = {}  # D layouts that passed, oldest first

    def __call__(self, ours: KVLayout, layout: KVLayout) -> None:
        if layout in self._valid:
            return
        layout.validate()
        check_same_dtype(ours, layout)
        if len(self._valid) >= self._keep:  # D engines come and go: forget the oldest
            del self._valid[next(iter(self._valid))]
        self._valid[layout] = None


@dataclass(frozen=True)
class TargetPlan:
    reg: m.Register
    pieces: Pieces | None  # None: another path than direct, which plans no descriptors
    choice: PathChoice | None  # None: no path driver, direct
    heads: HeadRange


def plan_writes(
    a: ev.IssueWrite,
    layout: KVLayout,
    check: LayoutCheck,
    heads_of: Callable[[m.Register], HeadRange],
    paths: Paths | None,
    pp_size: int = 1,
    model_layers: int = 0,
) -> list[TargetPlan]:
    """Each target's plan for our KV in ``layout``; raises ``LayoutError`` when one cannot
    be mapped. ``pp_size``: P's pipeline stages (``layout`` holds this stage's layers of
    the ``model_layers`` the model has)."""
    plans = []
    for reg in a.registrations:
        check(layout, reg.layout)
        reg = stage_target(reg, layout, pp_size, model_layers)
        if reg.num_tokens != a.num_tokens:
            raise LayoutError(f"D expects {reg.num_tokens} tokens, P computed {a.num_tokens}")
        heads = heads_of(reg)
        choice = paths.choose(reg, a.block_ids, heads) if paths else None
        pieces = None
        if choice is None or choice.path is XferPath.DIRECT:
            pieces = plan_direct(layout, a.block_ids, reg, heads)
        plans.append(TargetPlan(reg, pieces, choice, heads))
    return plans


def stage_target(reg: m.Register, ours: KVLayout, pp_size: int, model_layers: int) -> m.Register:
    """``reg`` as this P worker writes it: D must wait for as many pipeline stages as P
    runs, and with stages D's layout is cut to this stage's layers
    (``connector.core.stages.stage_view``); LayoutError otherwise."""
    check_stages(reg.p_stages, pp_size)
    if pp_size == 1:
        return reg
    return msgspec.structs.replace(reg, layout=stage_view(reg.layout, ours, model_layers))


def plan_direct(
    layout: KVLayout, src_blocks: ev.BlockTable, reg: m.Register, heads: HeadRange
) -> Pieces:
    """The descriptors that move our KV (in ``layout``) into ``reg``'s blocks."""
    return plan_transfer(
        layout,
        src_blocks,
        reg.layout,
        reg.block_ids,
        first_token=reg.first_token,
        num_tokens=reg.num_tokens,
        heads=heads,
    )


def new_report(a: ev.IssueWrite, layout: KVLayout) -> WriteReport:
    """The report of a WRITE issued now (descriptor prep starts)."""
    return WriteReport(
        a.transfer_id,
        a.request_id,
        False,
        None,
        time.time_ns(),
        blocks=sum(len(g) for g in a.block_ids),
        regions=len(layout.regions),
        targets=tuple(r.d_addr.agent for r in a.registrations),
    )


def account(report: WriteReport, plans: list[TargetPlan]) -> None:
    """The planned paths and sizes, into the report."""
    chosen = [p.choice for p in plans if p.choice is not None]
    if chosen:
        report.path = ",".join(sorted({c.path.value for c in chosen}))
        report.path_reason = "; ".join(sorted({c.reason for c in chosen}))
    for p in plans:
        if p.pieces is None:
            assert p.choice is not None
            report.bytes_total += p.choice.bytes_total
        else:
            report.bytes_total += p.pieces.bytes_total
            report.descriptors += p.pieces.count
