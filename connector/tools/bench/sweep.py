"""``pushkv bench --sweep``: input length x open-loop request rate, per configuration, against
one plain vLLM instance as the ideal: the study's figures for this machine.

Over 400 lines, one job: the sweep's driver and its CLI; its parts live in ``sweep_points``
(plan and point files), ``sweep_report``, ``trace_slices`` and ``plots``.

Owns: the sweep's command line, its run folder (``runs/sweep-<timestamp>/``: ``sweep.log``,
``sweep.json``, ``report.md``, the figures, and per configuration ``<config>/`` with its
servers' logs and trace files, one ``<point>.json`` per point, ``vllm bench serve``'s own
``<point>.bench.json`` and log, and ``<point>/`` holding that point's traces), and the driver:
per configuration, start its stack once (sized for the longest prompt), warm up, then every
point not done yet (``connector.tools.bench.sweep_points.is_done``: a resumed sweep skips
it) as one ``vllm bench serve --request-rate R`` run (Poisson arrivals, vLLM's default
burstiness of 1), cut that point's traces out and decompose its TTFT
(``connector.tools.bench.trace_slices``), write its results file, and go on; stop the stack.
``--interleave`` starts every stack at once and runs each point on all of them back to back
(A/B runs: the box drifts by 30 % within minutes, so a config-major order cannot resolve a
few %).

Bounded in time: each point by ``SweepPlan.limit_s`` and the whole sweep by ``--max-minutes``
(a point that would not fit is left for a resumed run, never cut short). A configuration that
fails to start, or a point that fails, is recorded with its reason and the sweep goes on.

Must not import vLLM, NIXL or torch (servers and clients are child processes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from connector.tools.bench import sweep_points, trace_slices
from connector.tools.bench.single import SINGLE, SINGLE_DESCRIPTION, SingleStack
from connector.tools.bench.stacks import (
    CONFIGS,
    NOPROG_MARKER,
    make_stack,
    on_free_ports,
    stop_and_check,
)
from connector.tools.bench.sweep_points import Point, SweepPlan
from connector.tools.bench.vllm_bench import (
    RunFailure,
    Workload,
    bench_command,
    git_commit,
    run_bench_serve,
)
from connector.tools.stack import ServerError
from connector.tools.tinymodel import MODELS, kv_bytes_per_token, make_tiny_model

# The ideal and the fair comparison first: if --max-minutes runs out, what is left for a
# resumed run is vLLM's busy-polling default configurations.
DEFAULT_CONFIGS = (
    SINGLE,
    "push",
    "vllm-pull-noprog",
    "vllm-push-noprog",
    "vllm-pull",
    "vllm-push",
)
# --smoke: the 2 x 2 sweep CI runs (tests/e2e/test_sweep_smoke.py).
SMOKE_LENGTHS: tuple[int, ...] = (64, 256)
SMOKE_RATES: tuple[float, ...] = (2.0, 4.0)
SMOKE_CONFIGS: tuple[str, ...] = (SINGLE, "push")
STACK_START_TIMEOUT_S = 300.0
STACK_START_ESTIMATE_S = 90.0  # start, warm-up and stop of one stack on the CPU box
WARMUP_SEED = 999
WARMUP_PROMPTS = 4
# KV room for this many requests of the longest length in flight (the cache of a tiny model).
KV_ROOM_REQUESTS = 16
MIN_KV_BYTES = 256 << 20

Log = Callable[[str], None]
_now = time.monotonic  # the sweep's clock (a test's fake one leaves other modules alone)


class SweepStack(Protocol):
    """What the sweep needs of a stack (``BenchStack`` and ``SingleStack`` both are)."""

    @property
    def url(self) -> str: ...
    def start(self, timeout_s: float = ...) -> float: ...
    def stop(self, timeout_s: float = ...) -> None: ...
    def ports(self) -> dict[str, int]: ...
    def group_leaders(self) -> list[int]: ...
    def describe(self) -> str: ...


@dataclass(frozen=True)
class Setup:
    """What every configuration of one sweep shares."""

    plan: SweepPlan
    model: Path
    server_args: tuple[str, ...]
    pin_servers: bool
    run_dir: Path
    deadline: float  # _now() by which the sweep ends
    warmup: bool = True
    gpus: tuple[str, str] | None = None  # P's and D's CUDA_VISIBLE_DEVICES (single: P's)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pushkv bench --sweep",
        description="Input length x open-loop request rate (Poisson arrivals), per "
        "configuration, against one plain vLLM instance: results, TTFT decompositions and "
        "figures in one run folder (docs/benchmarks.md).",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="2 x 2 points (64 and 256 tokens, 2 and 4 req/s), single and push, "
        "12 prompts a point, model tiny: the CI check",
    )
    p.add_argument(
        "--configs",
        nargs="+",
        choices=[SINGLE, *CONFIGS],
        default=None,
        help=f"in this order (default: {' '.join(DEFAULT_CONFIGS)})",
    )
    p.add_argument(
        "--model",
        default=None,
        help=f"{' or '.join(MODELS)} (built locally) or a model directory (default: tiny-kv, "
        "32 KiB of KV per token)",
    )
    p.add_argument(
        "--lengths",
        nargs="+",
        type=int,
        default=None,
        metavar="TOKENS",
        help="default 128 512 2048",
    )
    p.add_argument(
        "--rates",
        nargs="+",
        type=float,
        default=None,
        metavar="REQ_PER_S",
        help="default 0.5 1 2 4",
    )
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument(
        "--point-s",
        type=float,
        default=None,
        help="seconds of arrivals per point: a point sends rate x this many prompts "
        "(default 8; clamped to --min-prompts and --max-prompts)",
    )
    p.add_argument("--min-prompts", type=int, default=6)
    p.add_argument("--max-prompts", type=int, default=64)
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=64,
        help="vllm bench serve's cap on requests in flight (a safety net; open loop below it)",
    )
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help=f"each server's KV cache (default: room for {KV_ROOM_REQUESTS} requests of the "
        "longest length, at least 256 MiB)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="the servers' dtype; auto: bfloat16 on a GPU or a CPU with native bf16 "
        "(avx512_bf16 or AMX), float32 on other CPUs (AVX2 only: vLLM's bf16 path computes "
        "there at a few GFLOP/s, `python -m bench.cpu_dtype`)",
    )
    p.add_argument(
        "--server-args",
        default="",
        help="more vLLM flags for every server, one string (e.g. on a GPU host)",
    )
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"{WARMUP_PROMPTS} closed-loop requests of the longest length on each stack "
        "before its points (default: on, off with --smoke)",
    )
    p.add_argument("--pin-servers", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--gpus",
        nargs=2,
        default=None,
        metavar=("P", "D"),
        help="on a GPU host, P's and D's CUDA_VISIBLE_DEVICES (e.g. 0 1, or 0,1 2,3 for TP2); "
        "single runs on P's (default: every server sees every GPU)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--interleave",
        action="store_true",
        help="start every configuration's stack at once and run each point on all of them "
        "back to back (the order reversed at every other point), so configurations are "
        "compared minutes apart at most: for A/B runs of small differences",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=30.0,
        help="the whole sweep's bound: a point that would not end in time is left for a "
        "resumed run (--run-dir of this one)",
    )
    p.add_argument(
        "--rerender",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="run nothing: recompute each point's TTFT decomposition from its traces (this "
        "commit's critical-path model), then rewrite RUN_DIR's sweep.json, report and figures",
    )
    p.add_argument(
        "--rounds",
        type=Path,
        nargs="+",
        default=None,
        metavar="RUN_DIR",
        help="run nothing: read these sweeps (same plan) as rounds and print, per point, "
        "each configuration's median and range over them, and its TTFT against the single "
        "instance's and each traced configuration against its -notrace twin, paired per "
        "round and request by request (connector/tools/bench/sweep_rounds.py; to "
        "--rounds-out too)",
    )
    p.add_argument("--rounds-out", type=Path, default=None, metavar="FILE")
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="default runs/sweep-<timestamp>/; an existing sweep's folder resumes it "
        "(points whose results file says ok are skipped)",
    )
    return p.parse_args(list(argv))


def make_plan(args: argparse.Namespace) -> SweepPlan:
    lengths = args.lengths or (SMOKE_LENGTHS if args.smoke else (128, 512, 2048))
    # tiny-kv on one CPU core prefills 2048 tokens in about 0.65 s: P saturates near
    # 1.5 req/s there, while 128 and 512 tokens stay far below their limits.
    rates = args.rates or (SMOKE_RATES if args.smoke else (0.5, 1.0, 2.0, 4.0))
    return SweepPlan(
        tuple(lengths),
        tuple(rates),
        output_len=args.output_len,
        point_s=args.point_s or (3.0 if args.smoke else 8.0),
        min_prompts=12 if args.smoke else args.min_prompts,
        max_prompts=args.max_prompts,
        cap=args.max_concurrency,
        seed=args.seed,
    )


def resolve_model(name: str) -> tuple[Path, dict[str, Any]]:
    """A tiny model by name (built if absent) or a model directory; with its config.json."""
    path = make_tiny_model(name=name) if name in MODELS else Path(name).expanduser().resolve()
    try:
        config: dict[str, Any] = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    return path, config


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX), from /proc/cpuinfo."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True  # not Linux: leave vLLM's default alone
    flags = set(cpuinfo.split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def resolve_dtype(dtype: str, gpus: object) -> str:
    if dtype != "auto":
        return dtype
    return "bfloat16" if gpus is not None or cpu_has_native_bf16() else "float32"


def server_args(
    plan: SweepPlan, config: dict[str, Any], kv_bytes: int | None, dtype: str = "bfloat16"
) -> list[str]:
    """Context, dtype and KV size for the longest prompt (after ``VllmServer``'s own flags,
    so they win)."""
    limit = config.get("max_position_embeddings")
    if limit is not None and plan.max_model_len() > int(limit):
        raise SystemExit(
            f"the longest point needs {plan.max_model_len()} tokens of context; the model has "
            f"{limit} (use --model tiny-kv, or shorter --lengths)"
        )
    if kv_bytes is None:
        per_token = _kv_per_token(config, 4 if dtype == "float32" else 2)
        kv_bytes = max(MIN_KV_BYTES, per_token * plan.max_model_len() * KV_ROOM_REQUESTS)
    return [
        "--max-model-len",
        str(plan.max_model_len()),
        "--dtype",
        dtype,
        "--kv-cache-memory-bytes",
        str(kv_bytes),
    ]


def _kv_per_token(config: dict[str, Any], dtype_bytes: int = 2) -> int:
    try:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return kv_bytes_per_token(
            {
                "num_hidden_layers": config["num_hidden_layers"],
                "num_key_value_heads": config.get(
                    "num_key_value_heads", config["num_attention_heads"]
                ),
                "head_dim": head_dim,
            },
            dtype_bytes,
        )
    except (KeyError, TypeError, ZeroDivisionError):
        return 0  # unknown geometry: the minimum size


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
    left = setup.deadline - _now()
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


# --- the command ------------------------------------------------------------------------------


@contextlib.contextmanager
def _console(run_dir: Path, total: int) -> Iterator[tuple[Log, Callable[[str], None]]]:
    """A log (console and ``sweep.log``) and a rich progress bar over the points."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with (
        (run_dir / "sweep.log").open("a") as log_file,
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        ) as progress,
    ):
        task = progress.add_task("sweep", total=total)

        def log(msg: str) -> None:
            line = f"{datetime.now():%H:%M:%S} {msg}"
            progress.console.print(line, markup=False, highlight=False)
            log_file.write(line + "\n")
            log_file.flush()

        def advance(what: str) -> None:
            progress.update(task, advance=1, description=what)

        yield log, advance


def rerender(run_dir: Path) -> int:
    """``--rerender``: the points' decompositions again, from their traces, and the files
    built from them; the run's metadata stays, with the commit that re-rendered it."""
    data = json.loads((run_dir / sweep_points.SWEEP_FILE).read_text())
    for path in sorted(run_dir.glob("*/in*-r*.json")):
        folder = path.with_suffix("")
        if path.name.endswith(".bench.json") or not folder.is_dir():
            continue
        record = json.loads(path.read_text())
        record["decomposition"] = trace_slices.decomposition(folder)
        path.write_text(json.dumps(record, indent=2) + "\n")
    meta = {k: v for k, v in data.items() if k != "points"}
    meta["rerendered_at"] = git_commit()
    _publish(run_dir, meta, print)
    return 0


def _meta(argv: Sequence[str], setup: Setup, configs: Sequence[str]) -> dict[str, Any]:
    commit = git_commit()
    return {
        "kind": "sweep",
        "argv": ["pushkv", "bench", "--sweep", *argv],
        "git_commit": commit or None,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "model": str(setup.model),
        "plan": sweep_points.plan_json(setup.plan),
        "configs": list(configs),
        "server_args": list(setup.server_args),
        "pin_servers": setup.pin_servers,
        "gpus": None if setup.gpus is None else list(setup.gpus),
        "arrivals": "Poisson (vllm bench serve --request-rate, burstiness 1)",
        "interleaved": "--interleave" in argv,
    }


def main(argv: Sequence[str]) -> int:
    """Run (or resume) a sweep; 0 when every point of every configuration completed all its
    requests."""
    args = parse_args(argv)
    if args.rerender is not None:
        return rerender(args.rerender.resolve())
    if args.rounds is not None:
        from connector.tools.bench import sweep_rounds

        return sweep_rounds.main(args.rounds, args.rounds_out)
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    plan = make_plan(args)
    configs = list(args.configs or (SMOKE_CONFIGS if args.smoke else DEFAULT_CONFIGS))
    model, model_config = resolve_model(args.model or ("tiny" if args.smoke else "tiny-kv"))
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = (args.run_dir or Path("runs") / f"sweep-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    setup = Setup(
        plan,
        model,
        (
            *server_args(
                plan, model_config, args.kv_cache_bytes, resolve_dtype(args.dtype, args.gpus)
            ),
            *shlex.split(args.server_args),
        ),
        args.pin_servers,
        run_dir,
        _now() + args.max_minutes * 60.0,
        args.warmup if args.warmup is not None else not args.smoke,
        None if args.gpus is None else (args.gpus[0], args.gpus[1]),
    )
    meta = _meta(argv, setup, configs)
    todo = {
        n: [p for p in plan.points() if not sweep_points.is_done(run_dir, n, p)] for n in configs
    }
    total = sum(len(v) for v in todo.values())
    records: list[dict[str, Any]] | None = None
    with _console(run_dir, total) as (log, advance):
        log(
            f"sweep {run_dir}: configs {configs}; lengths {plan.lengths}; rates {plan.rates}/s; "
            f"output {plan.output_len}; model {model.name}; {total} point(s) to run "
            f"({len(configs) * len(plan.points()) - total} done before); estimate "
            f"{estimate_minutes(plan, [n for n in configs if todo[n]]):.0f} min, "
            f"bound {args.max_minutes:g} min"
        )
        if args.interleave:
            log(f"interleaved: {', '.join(configs)} up at once, each point on all back to back")
            run_interleaved(configs, setup, todo, log, advance)
        else:
            for name in configs:
                if not todo[name]:
                    log(f"[{name}] every point done before: skipped")
                    continue
                if setup.deadline - _now() < STACK_START_ESTIMATE_S:
                    log(f"[{name}] out of time before starting: left for a resumed run")
                    continue
                description = SINGLE_DESCRIPTION if name == SINGLE else CONFIGS[name].description
                log(f"[{name}] {description}")
                run_config(name, setup, todo[name], log, advance)
                records = _publish(run_dir, meta, log)  # each stack's points as they end
        if records is None:  # interleaved, or no stack ran: publish what the folder holds
            records = _publish(run_dir, meta, log)
    complete = {(r["config"], r["point"]) for r in records if r["ok"]}
    wanted = {(n, p.name) for n in configs for p in plan.points()}
    return 0 if wanted <= complete else 1


def _publish(run_dir: Path, meta: dict[str, Any], log: Log) -> list[dict[str, Any]]:
    """``sweep.json``, ``report.md`` and the figures from every point written so far."""
    from connector.tools.bench import plots, sweep_report

    records = sweep_points.load_points(run_dir)
    data = sweep_points.write_sweep(run_dir, meta, records)
    (run_dir / "report.md").write_text(sweep_report.markdown(data))
    for line in plots.write_figures(run_dir, data):
        log(line)
    return records
