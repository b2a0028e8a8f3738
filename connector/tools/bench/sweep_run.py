"""The sweep's driver: per configuration, its stack started once and warmed up, then each
point as one ``vllm bench serve`` run, its traces cut out and decomposed, its results file
written; ``--interleave`` runs each point on every stack back to back. Bounded in time:
each point by ``SweepPlan.limit_s`` and the whole sweep by ``Setup.deadline`` (a point that
would not fit is left for a resumed run, never cut short). Servers and clients are child
processes: no vLLM, NIXL or torch here."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from connector.tools.bench import sweep_points, trace_slices
from connector.tools.bench.single import SINGLE, SingleStack
from connector.tools.bench.stacks import (
    CONFIGS,
    NOPROG_MARKER,
    make_stack,
    on_free_ports,
    stop_and_check,
)
from connector.tools.bench.sweep_points import Point, SweepPlan
from connector.tools.bench.sweep_setup import WARMUP_PROMPTS, Log, Setup
from connector.tools.bench.vllm_bench import (
    RunFailure,
    Workload,
    bench_command,
    run_bench_serve,
)
from connector.tools.stack import ServerError

STACK_START_TIMEOUT_S = 300.0
STACK_START_ESTIMATE_S = 90.0  # start, warm-up and stop of one stack on the CPU box
WARMUP_SEED = 999
now = time.monotonic  # the sweep's clock (a test's fake one leaves other modules alone)


class SweepStack(Protocol):
    """What the sweep needs of a stack (``BenchStack`` and ``SingleStack`` both are)."""

    @property
    def url(self) -> str: ...
    def start(self, timeout_s: float = ...) -> float: ...
    def stop(self, timeout_s: float = ...) -> None: ...
    def ports(self) -> dict[str, int]: ...
    def group_leaders(self) -> list[int]: ...
    def describe(self) -> str: ...


# --- stacks ---------------------------------------------------------------------------------


def _make(name: str, setup: Setup, cfg_dir: Path) -> SweepStack:
    if name == SINGLE:
        return SingleStack(
            setup.model,
            cfg_dir,
            setup.server_args,
            pin_servers=setup.pin_servers,
            gpus=None if setup.gpus is None else setup.gpus[0],
        )
    return make_stack(
        CONFIGS[name], setup.model, cfg_dir, setup.pin_servers, setup.server_args, setup.gpus
    )


def _start(name: str, setup: Setup, cfg_dir: Path, log: Log) -> SweepStack:
    """A stack on ports free right now, started and healthy (or ServerError)."""
    stack = on_free_ports(lambda: _make(name, setup, cfg_dir), log, name)
    log(f"[{name}] starting; ports {stack.ports()}")
    try:
        stack.start(STACK_START_TIMEOUT_S)
        if name != SINGLE and CONFIGS[name].progress_thread_off:
            for log_file in (cfg_dir / "prefill.log", cfg_dir / "decode.log"):
                if NOPROG_MARKER not in log_file.read_text(errors="replace"):
                    raise ServerError(f"{log_file} lacks {NOPROG_MARKER!r}: patch not active")
    except BaseException:
        _stop(name, stack, log)
        raise
    log(f"[{name}] healthy\n{stack.describe()}")
    return stack


def _stop(name: str, stack: SweepStack, log: Log) -> None:
    stop_and_check(name, stack, log)


# --- points ---------------------------------------------------------------------------------


def _workload(plan: SweepPlan, point: Point) -> Workload:
    n = plan.num_prompts(point)
    return Workload(
        point.input_len,
        plan.output_len,
        ((plan.cap, n),),
        seed=plan.seed_of(point),
        request_rate=point.rate,
    )


def _warm_up(setup: Setup, stack: SweepStack, cfg_dir: Path) -> RunFailure | None:
    """A few closed-loop requests of the longest length; their JSON is only checked."""
    plan = setup.plan
    workload = Workload(max(plan.lengths), plan.output_len, ((2, WARMUP_PROMPTS),))
    out = cfg_dir / "warmup.json"
    failure = run_bench_serve(
        bench_command(stack.url, setup.model, workload, 2, WARMUP_PROMPTS, WARMUP_SEED, out),
        cfg_dir / "bench-warmup.log",
        workload.limit_s(WARMUP_PROMPTS),
        zygote=setup.zygote,
    )
    if failure is None:
        done = json.loads(out.read_text()).get("completed", 0) if out.is_file() else 0
        if done < WARMUP_PROMPTS:
            failure = RunFailure(f"{done}/{WARMUP_PROMPTS} warm-up requests completed")
    return failure


def run_point(
    name: str,
    setup: Setup,
    stack: SweepStack,
    point: Point,
    limit_s: float,
    budget_cut: bool = False,
) -> tuple[dict[str, Any], RunFailure | None]:
    """One ``vllm bench serve`` run at ``point``; its traces and decomposition; its file.
    ``budget_cut``: ``limit_s`` is what the sweep's ``--max-minutes`` left, shorter than the
    point's own bound, so a run killed at it ran out of time rather than hung."""
    plan, cfg_dir = setup.plan, setup.run_dir / name
    out = sweep_points.bench_file(setup.run_dir, name, point)
    out.unlink(missing_ok=True)  # a failed earlier try must not pass for this one's
    before = trace_slices.sizes(cfg_dir)
    t0 = time.monotonic()
    failure = run_bench_serve(
        bench_command(
            stack.url,
            setup.model,
            _workload(plan, point),
            plan.cap,
            plan.num_prompts(point),
            plan.seed_of(point),
            out,
        ),
        cfg_dir / f"{point.name}.log",
        limit_s,
        zygote=setup.zygote,
    )
    wall = time.monotonic() - t0
    if failure is not None and failure.hung and budget_cut:
        failure = RunFailure(f"cut after {limit_s:.0f} s by the sweep's --max-minutes, unfinished")
    if failure is None and not out.is_file():
        failure = RunFailure(f"vllm bench serve saved no {out.name}")
    after = trace_slices.wait_quiet(cfg_dir)
    dest = sweep_points.traces_dir(setup.run_dir, name, point)
    trace_slices.copy_slice(cfg_dir, before, after, dest)
    bench = json.loads(out.read_text()) if failure is None else None
    record = sweep_points.point_record(
        name,
        point,
        plan,
        bench,
        failure.reason if failure else "",
        trace_slices.decomposition(dest),
        wall,
    )
    sweep_points.write_point(setup.run_dir, record)
    return record, failure


def _expected_s(plan: SweepPlan, point: Point) -> float:
    """What a point takes on a stack that keeps up: arrivals, client start-up, drain."""
    return plan.num_prompts(point) / point.rate + 20.0


def estimate_minutes(plan: SweepPlan, configs: Sequence[str]) -> float:
    per_stack = STACK_START_ESTIMATE_S + sum(_expected_s(plan, p) for p in plan.points())
    return len(configs) * per_stack / 60.0


def _ready(
    name: str, setup: Setup, todo: list[Point], log: Log, advance: Callable[[str], None]
) -> SweepStack | None:
    """``name``'s stack started and warmed up; None (its points recorded as failed, with
    the reason) if it did not start."""
    cfg_dir = setup.run_dir / name
    try:
        stack = _start(name, setup, cfg_dir, log)
    except ServerError as exc:
        reason = f"stack did not start: {str(exc).splitlines()[0]}"
        log(f"[{name}] FAILED: {reason}")
        for point in todo:
            sweep_points.write_point(
                setup.run_dir, sweep_points.point_record(name, point, setup.plan, None, reason)
            )
            advance(f"{name} {point.name} failed")
        return None
    try:
        if setup.warmup and (failure := _warm_up(setup, stack, cfg_dir)) is not None:
            log(f"[{name}] warm-up failed: {failure.reason}")
        trace_slices.wait_quiet(cfg_dir)  # the warm-up's spans stay out of the first point
    except BaseException:
        _stop(name, stack, log)
        raise
    return stack


def _point(
    name: str,
    setup: Setup,
    stack: SweepStack,
    point: Point,
    log: Log,
    advance: Callable[[str], None],
) -> bool:
    """Run one point if it fits before the deadline and log it. False: the stack is done
    (out of time, or the point hung)."""
    plan = setup.plan
    left = setup.deadline - now()
    if left < _expected_s(plan, point):
        log(f"[{name}] out of time at {point.name}: what is left is for a resumed run")
        return False
    limit = plan.limit_s(point)
    record, failure = run_point(name, setup, stack, point, min(limit, left), left < limit)
    m, dec = record["metrics"], record["decomposition"]
    log(
        f"[{name}] {point.name}: {record['completed']}/{record['num_prompts']} ok, "
        f"TTFT p50 {m.get('median_ttft_ms', float('nan')):.1f} ms "
        f"p90 {m.get('p90_ttft_ms', float('nan')):.1f} ms, "
        f"TPOT {m.get('mean_tpot_ms', float('nan')):.2f} ms"
        + (f", {dec['requests']} traced" if dec else "")
        + (f" FAILED: {record['reason']}" if not record["ok"] else "")
    )
    advance(f"{name} {point.name}")
    if failure is not None and failure.hung:
        log(f"[{name}] {point.name} hung: the stack's other points are left")
        return False
    return True


def run_config(
    name: str, setup: Setup, todo: list[Point], log: Log, advance: Callable[[str], None]
) -> None:
    """Start ``name``'s stack, warm up, run ``todo`` while time is left, stop."""
    stack = _ready(name, setup, todo, log, advance)
    if stack is None:
        return
    try:
        for point in todo:
            if not _point(name, setup, stack, point, log, advance):
                return
    finally:
        _stop(name, stack, log)


def run_interleaved(
    configs: Sequence[str],
    setup: Setup,
    todo: dict[str, list[Point]],
    log: Log,
    advance: Callable[[str], None],
) -> None:
    """``--interleave``: every stack up at once (pinned alike, so an idle one costs the
    other only its idle share), each point on all of them back to back, the order reversed
    at every other point so that neither configuration always runs first."""
    stacks: dict[str, SweepStack] = {}
    try:
        for name in configs:
            if todo[name] and (stack := _ready(name, setup, todo[name], log, advance)):
                stacks[name] = stack
        points = [p for p in setup.plan.points() if any(p in todo[n] for n in stacks)]
        for index, point in enumerate(points):
            order = list(stacks) if index % 2 == 0 else list(reversed(stacks))
            for name in order:
                if point in todo[name] and name in stacks:
                    if not _point(name, setup, stacks[name], point, log, advance):
                        _stop(name, stacks.pop(name), log)
    finally:
        for name, stack in stacks.items():
            _stop(name, stack, log)
