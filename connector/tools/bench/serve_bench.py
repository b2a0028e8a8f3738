"""The push-vs-pull serving benchmark: ``pushkv bench [--quick]``.

Owns the command: its options, the run folder ``runs/bench-<timestamp>/`` (``bench.log``,
one log per process and per run, the rounds of ``--repeats``) and ``main``. One
configuration's run (stack, warm-up, levels, stop, fidelity, log signals) is
``connector.tools.bench.serve_run``'s; running ``vllm bench serve`` itself lives in
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
import os
import platform
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from connector.tools.bench.level_result import LevelResult
from connector.tools.bench.run_folder import (
    arrivals,
    publish,
    publish_rounds,
    rerender,
    write_json,
    write_report,
)
from connector.tools.bench.serve_run import Log, run_config
from connector.tools.bench.stacks import (
    CONFIGS,
    DEFAULT_CONFIGS,
    QUICK_CONFIGS,
    require_fronts,
    wait_for_quiet_machine,
)
from connector.tools.bench.vllm_bench import Workload, git_commit
from connector.tools.tinymodel import make_tiny_model


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
    require_fronts(names)
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
