"""The push-vs-pull serving benchmark: ``pushkv bench [--quick]``.

Over 400 lines, one job: the run's driver and its CLI; the parts live in the modules below.

Owns: the per-configuration sequence (start the stack on free ports, warm up, one
``vllm bench serve`` run per concurrency level, stop by process group and check that the
processes and ports are gone: ``run_config``), the log signals counted per stack, the run
folder ``runs/bench-<timestamp>/`` (``bench.log``, one log per process and per run, the
rounds of ``--repeats``) and ``main``. Running ``vllm bench serve`` itself lives in
``connector.tools.bench.vllm_bench``, the configurations and stacks in
``connector.tools.bench.stacks``, the tables and ratios in ``connector.tools.bench.report``,
writing (and ``--rerender``ing) a folder's ``results.json`` and ``report.md`` in
``connector.tools.bench.run_folder``.

Every configuration (``connector.tools.bench.stacks.CONFIGS``) sees the same model
(``make_tiny_model()``), P/D flags, CPU binding and prompts: ``vllm bench serve
--dataset-name random`` with the same ``--seed`` per concurrency level (a different seed per
level, so a level never hits the prefix cache with the previous level's prompts). A warm-up
run (its own seed; its JSON is kept only to check that every warm-up request completed, and
is not a result) comes first on each stack. A configuration that fails (start-up, warm-up, a
hang past the limit) is recorded as failed with the reason, and the run goes on.

Must not import vLLM, NIXL or torch: everything vLLM runs in child processes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from connector.tools.bench import fidelity
from connector.tools.bench.report import LevelResult
from connector.tools.bench.run_folder import (
    arrivals,
    publish,
    publish_rounds,
    rerender,
    write_json,
    write_report,
)
from connector.tools.bench.stacks import (
    CONFIGS,
    DEFAULT_CONFIGS,
    NOPROG_MARKER,
    QUICK_CONFIGS,
    BenchConfig,
    BenchStack,
    make_stack,
    on_free_ports,
    other_vllm_pids,
    stop_and_check,
    wait_for_quiet_machine,
)
from connector.tools.bench.vllm_bench import (
    RunFailure,
    Workload,
    bench_command,
    decode_prompt_tokens,
    git_commit,
    run_bench_serve,
)
from connector.tools.stack import ServerError, group_pids
from connector.tools.tinymodel import make_tiny_model
from telemetry.traces import RunFolderError, read_run

STACK_START_TIMEOUT_S = 300.0
WARMUP_SEED = 999
# Log lines worth counting after each configuration (label: substring of the line).
LOG_SIGNALS: dict[str, str] = {
    "lease_expired": "Releasing expired KV blocks",  # P gave up on a transfer (30 s lease)
    "registration_timeout": "timed out after",  # D's push registration watchdog
    "slow_submission": "slow NIXL submission",
    "handshake_failed": "handshake_setup_failed",
    "traceback": "Traceback (most recent call last)",
    "error": " ERROR ",
    # = connector.tools.bench.vllm_keepcpu.KEPT_MARKER
    "cpu_pin_undone": "connector.tools.bench.vllm_keepcpu: kept CPUs",
}

Log = Callable[[str], None]


def log_signals(stack: BenchStack) -> dict[str, dict[str, int]]:
    """How often each ``LOG_SIGNALS`` line occurs in each server's log before it began to
    shut down (non-zero counts only)."""
    counts: dict[str, dict[str, int]] = {}
    for name, server in (("prefill", stack.prefill), ("decode", stack.decode)):
        try:
            lines = server.log.read_text(errors="replace").splitlines()
        except OSError:
            continue  # no log to read: nothing to count for this server
        # Stop at shutdown: our own stop makes vLLM log an EngineDeadError traceback.
        lines = list(itertools.takewhile(lambda line: "[shutdown]" not in line, lines))
        found = {
            label: sum(needle in line for line in lines) for label, needle in LOG_SIGNALS.items()
        }
        counts[name] = {k: v for k, v in found.items() if v}
    return counts


@dataclass
class ConfigRun:
    """One configuration's stack: its level results plus what the stack itself showed."""

    results: list[LevelResult]
    start_duration_s: float | None = None
    log_signals: dict[str, dict[str, int]] | None = None


def _start(
    config: BenchConfig, model: Path, run_dir: Path, log: Log, pin_servers: bool
) -> BenchStack:
    """A stack whose ports are all free right now, started and healthy (or ServerError)."""
    stack = on_free_ports(lambda: make_stack(config, model, run_dir, pin_servers), log, config.name)
    log(f"[{config.name}] starting ({config.description}); ports {stack.ports()}")
    try:
        stack.start(STACK_START_TIMEOUT_S)
    except ServerError:
        _stop(config, stack, log)
        raise
    log(f"[{config.name}] healthy after {stack.start_duration_s:.1f} s\n{stack.describe()}")
    if config.progress_thread_off:
        for server in (stack.prefill, stack.decode):
            if NOPROG_MARKER not in server.log.read_text(errors="replace"):
                _stop(config, stack, log)
                raise ServerError(f"{server.log} lacks {NOPROG_MARKER!r}: patch not active")
    return stack


def _stop(config: BenchConfig, stack: BenchStack, log: Log) -> None:
    stop_and_check(config.name, stack, log)


def _foreign_vllm(stack: BenchStack) -> list[int]:
    mine = {pid for leader in stack.group_leaders() for pid in group_pids(leader)}
    return sorted(set(other_vllm_pids()) - mine)


def run_config(
    config: BenchConfig, model: Path, run_dir: Path, workload: Workload, log: Log, pin_servers: bool
) -> ConfigRun:
    """Start ``config``'s stack, warm up, run every level, stop. Never raises for a failed
    configuration: its levels come back as failures carrying the reason."""
    cfg_dir = run_dir / config.name
    try:
        stack = _start(config, model, cfg_dir, log, pin_servers)
    except ServerError as exc:
        return ConfigRun(
            _fail_all(
                config, f"stack did not start: {str(exc).splitlines()[0]}", workload.levels, log
            )
        )
    run = ConfigRun([], stack.start_duration_s)
    try:
        run.results = _run_levels(config, stack, model, cfg_dir, workload, log)
        return run
    finally:
        _stop(config, stack, log)
        _check_fidelity(run.results, cfg_dir, log)  # after the stop: every span is flushed
        run.log_signals = log_signals(stack)
        if any(run.log_signals.values()):
            log(f"[{config.name}] log signals: {run.log_signals}")
        for r in run.results:
            if not r.ok and run.log_signals.get("prefill", {}).get("lease_expired"):
                r.reason += (
                    f" [P: {run.log_signals['prefill']['lease_expired']} transfer(s) "
                    f"never started before P's lease expired]"
                )


def _check_fidelity(results: Sequence[LevelResult], cfg_dir: Path, log: Log) -> None:
    """Each level's client TTFTs against the router's traces (``fidelity``'s criterion)."""
    try:
        traces = read_run(cfg_dir).traces
    except RunFolderError:
        return  # tracing off: nothing to check
    client: dict[str, float] = {}
    for r in results:
        if not (r.ok and r.result_file and r.request_id_prefix):
            continue
        bench = json.loads((cfg_dir.parent / r.result_file).read_text())
        fid = fidelity.check(bench, r.request_id_prefix, traces)
        r.fidelity = fid.to_json()
        client |= fidelity.client_ttfts_ms(bench, r.request_id_prefix)
        log(f"[{r.config}] c={r.concurrency} trace fidelity: {fid.summary()}")
    # the dashboard shows these next to each trace's TTFT (dashboard.data.CLIENT_TTFTS_FILE)
    (cfg_dir / "client_ttfts.json").write_text(json.dumps(client))


def _fail_all(
    config: BenchConfig, reason: str, levels: Sequence[tuple[int, int]], log: Log
) -> list[LevelResult]:
    log(f"[{config.name}] FAILED: {reason}")
    return [LevelResult.failure(config.name, c, n, reason) for c, n in levels]


def _run_levels(
    config: BenchConfig, stack: BenchStack, model: Path, cfg_dir: Path, workload: Workload, log: Log
) -> list[LevelResult]:
    """The warm-up, then one saved ``vllm bench serve`` run per level, on a healthy stack."""
    results: list[LevelResult] = []
    t0 = time.monotonic()
    warmup_file = cfg_dir / "warmup.json"  # saved only to check it; not a result
    failure = run_bench_serve(
        bench_command(
            stack.url,
            model,
            workload,
            workload.warmup_concurrency,
            workload.warmup_prompts,
            WARMUP_SEED,
            warmup_file,
        ),
        cfg_dir / "bench-warmup.log",
        workload.limit_s(workload.warmup_prompts),
    )
    if failure is None:  # vllm bench serve exits 0 even when every request failed
        done = (
            json.loads(warmup_file.read_text()).get("completed", 0)
            if (warmup_file.is_file())
            else 0
        )
        if done < workload.warmup_prompts:
            failure = RunFailure(f"{done}/{workload.warmup_prompts} warm-up requests completed")
    if failure is not None:
        return _fail_all(config, f"warm-up failed: {failure.reason}", workload.levels, log)
    log(
        f"[{config.name}] warm-up ({workload.warmup_prompts} requests) "
        f"{time.monotonic() - t0:.1f} s"
    )
    for index, (conc, prompts) in enumerate(workload.levels):
        result_file = cfg_dir / f"c{conc}.json"
        foreign = _foreign_vllm(stack)
        before = decode_prompt_tokens(stack.decode.url)
        t0 = time.monotonic()
        prefix = f"bench-{config.name}-c{conc}-"
        failure = run_bench_serve(
            bench_command(
                stack.url,
                model,
                workload,
                conc,
                prompts,
                workload.level_seed(index),
                result_file,
                request_id_prefix=prefix,
            ),
            cfg_dir / f"bench-c{conc}.log",
            workload.limit_s(prompts),
        )
        if failure is None and not result_file.is_file():
            failure = RunFailure(f"vllm bench serve saved no {result_file.name}")
        if failure is not None:
            results.append(LevelResult.failure(config.name, conc, prompts, failure.reason))
            log(f"[{config.name}] c={conc} FAILED: {failure.reason}")
            if failure.hung:  # the stack is wedged: the other levels would hang too
                results += _fail_all(
                    config, f"skipped: c={conc} hung", workload.levels[index + 1 :], log
                )
                break
            continue
        result = LevelResult.from_bench_json(
            config.name,
            conc,
            prompts,
            json.loads(result_file.read_text()),
            str(result_file.relative_to(cfg_dir.parent)),
        )
        after = decode_prompt_tokens(stack.decode.url)
        result.decode_prompt_tokens = {k: after[k] - before.get(k, 0.0) for k in after}
        result.request_id_prefix = prefix
        result.foreign_vllm_pids = foreign
        results.append(result)
        m = result.metrics
        log(
            f"[{config.name}] c={conc}: {result.completed}/{prompts} ok, "
            f"{result.failed} failed, median TTFT {m.get('median_ttft_ms', 0):.1f} ms, "
            f"mean TPOT {m.get('mean_tpot_ms', 0):.2f} ms, "
            f"{m.get('request_throughput', 0):.2f} req/s "
            f"({time.monotonic() - t0:.0f} s wall)"
        )
    return results


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pushkv bench", description=__doc__.split("\n")[0])
    p.add_argument(
        "--sweep",
        action="store_true",
        help="input length x request rate against one plain instance, with figures: "
        "its own flags (pushkv bench --sweep --help; connector/tools/bench/sweep.py)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: concurrency 4 only, 12 prompts, push and vllm-push only",
    )
    p.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        default=None,
        help=f"configurations to run, in this order (default: {' '.join(DEFAULT_CONFIGS)})",
    )
    p.add_argument(
        "--levels",
        nargs="+",
        default=None,
        metavar="CONC:PROMPTS",
        help="concurrency levels, e.g. 4:160 16:480 (the default)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        metavar="REQ_PER_S",
        help="open loop: Poisson arrivals at this mean rate at every level (still "
        "capped at its concurrency), the same offered load for every stack; "
        "default: closed loop",
    )
    p.add_argument(
        "--pin-servers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="confine P's and D's every process (API server, EngineCore, threads) "
        "to their engine's CPU, as if each were a host of its own (default); "
        "--no-pin-servers binds only the engines' compute threads",
    )
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="default: runs/bench-<timestamp>/ in the current folder",
    )
    p.add_argument(
        "--wait",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wait until no other vLLM server runs (default: on, off with --quick)",
    )
    p.add_argument("--wait-timeout-s", type=float, default=2400.0)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="run every configuration N times in N rounds, the order rotated each "
        "round (round-<i>/ holds each); the top report gives the medians and "
        "per-round ratios (a small shared host drifts a lot between runs)",
    )
    p.add_argument(
        "--rerender",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="start nothing: re-read RUN_DIR's saved vllm bench serve JSON files "
        "and rewrite its report.md and results.json",
    )
    return p.parse_args(list(argv))


def _workload(args: argparse.Namespace) -> Workload:
    if args.levels:
        levels = tuple((int(c), int(n)) for c, n in (s.split(":") for s in args.levels))
    else:
        levels = ((4, 12),) if args.quick else Workload.levels
    return Workload(
        args.input_len,
        args.output_len,
        levels,
        warmup_prompts=4 if args.quick else Workload.warmup_prompts,
        seed=args.seed,
        request_rate=args.request_rate,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 if every configuration produced numbers at every level."""
    # SIGTERM (e.g. from `timeout`) must still stop the stacks: turn it into SystemExit so
    # that every finally block runs (Python's default SIGTERM action skips them).
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    argv = sys.argv[1:] if argv is None else argv
    if "--sweep" in argv:  # a command of its own, with its own flags
        from connector.tools.bench import sweep

        return sweep.main([a for a in argv if a != "--sweep"])
    args = parse_args(argv)
    if args.rerender is not None:
        return rerender(args.rerender.resolve())
    workload = _workload(args)
    names = args.configs or list(QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = (args.run_dir or Path("runs") / f"bench-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    log_file = (run_dir / "bench.log").open("a")

    def log(msg: str) -> None:
        line = f"{datetime.now():%H:%M:%S} {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    log(
        f"run folder {run_dir}; configs {names}; levels {workload.levels}; "
        f"{arrivals(workload.request_rate)}"
    )
    wait = args.wait if args.wait is not None else not args.quick
    if wait and not wait_for_quiet_machine(args.wait_timeout_s, log=log):
        log("other vLLM servers still running: measuring anyway (numbers are suspect)")
    model = make_tiny_model()
    meta: dict[str, Any] = {
        "started": datetime.now().isoformat(timespec="seconds"),
        "argv": ["pushkv", "bench", *(sys.argv[1:] if argv is None else argv)],
        "git_commit": git_commit(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "model": str(model),
        "workload": asdict(workload),
        "configs": {n: asdict(CONFIGS[n]) for n in names},
        "cpu_binding": {"prefill": "0", "decode": "1"},
        # True: P's and D's whole process trees confined to those CPUs (as separate hosts)
        "pin_servers": args.pin_servers,
    }
    t_start = time.monotonic()
    if args.repeats <= 1:
        results = _run_round(names, model, run_dir, workload, log, args.pin_servers, meta)
        duration = time.monotonic() - t_start
        publish(run_dir, meta, results, duration)
        log(
            f"total {duration:.0f} s; report {run_dir / 'report.md'}; "
            f"data {run_dir / 'results.json'}"
        )
        log_file.close()
        return 0 if all(r.ok for r in results) else 1
    rounds: list[list[LevelResult]] = []
    for i in range(args.repeats):
        # Rotate the order so that no configuration always runs first (or right after the
        # slowest one): drift over the minutes of a round then falls on each in turn.
        order = names[i % len(names) :] + names[: i % len(names)]
        round_dir = run_dir / f"round-{i + 1}"
        round_dir.mkdir(parents=True, exist_ok=True)
        log(f"round {i + 1} of {args.repeats}: {order}")
        round_meta = {**meta, "round": i + 1, "configs": {n: meta["configs"][n] for n in order}}
        t0 = time.monotonic()
        results = _run_round(order, model, round_dir, workload, log, args.pin_servers, round_meta)
        write_json(round_dir, round_meta, results, time.monotonic() - t0)
        write_report(round_dir, round_meta, results, time.monotonic() - t0)
        rounds.append(results)
    duration = time.monotonic() - t_start
    meta["rounds"] = [f"round-{i + 1}" for i in range(len(rounds))]
    publish_rounds(run_dir, meta, rounds, duration)
    for line in meta["round_tally"]:
        log(line)
    log(
        f"total {duration:.0f} s; medians of {len(rounds)} rounds: report "
        f"{run_dir / 'report.md'}; data {run_dir / 'results.json'}"
    )
    log_file.close()
    return 0 if all(r.ok for rs in rounds for r in rs) else 1


def _run_round(
    names: Sequence[str],
    model: Path,
    run_dir: Path,
    workload: Workload,
    log: Log,
    pin_servers: bool,
    meta: dict[str, Any],
) -> list[LevelResult]:
    """Every configuration of ``names`` once, in that order, into ``run_dir``."""
    t_start = time.monotonic()
    results: list[LevelResult] = []
    meta["stacks"] = {}
    for name in names:
        t0 = time.monotonic()
        run = run_config(CONFIGS[name], model, run_dir, workload, log, pin_servers)
        results += run.results
        meta["stacks"][name] = {
            "start_duration_s": run.start_duration_s,
            "log_signals": run.log_signals,
            "duration_s": round(time.monotonic() - t0, 1),
        }
        log(f"[{name}] done in {time.monotonic() - t0:.0f} s")
        write_json(run_dir, meta, results, time.monotonic() - t_start)
    return results


if __name__ == "__main__":
    sys.exit(main())
