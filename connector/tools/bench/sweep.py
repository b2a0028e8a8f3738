"""``pushkv bench --sweep``: input length x open-loop request rate, per configuration, against
one plain vLLM instance as the ideal: the study's figures for this machine.

Owns the command: its run folder (``runs/sweep-<timestamp>/``: ``sweep.log``, ``sweep.json``,
``report.md``, the figures, ``bench-client.log`` (the process every ``vllm bench serve`` run
is forked from: ``client_zygote``), and per configuration ``<config>/`` with its servers' logs and
trace files, one ``<point>.json`` per point, ``vllm bench serve``'s own ``<point>.bench.json``
and log, and ``<point>/`` holding that point's traces), its console, resuming (a point whose
results file says ok is skipped: ``sweep_points.is_done``), ``--rerender`` and
``--rounds``. Its parts: ``sweep_args`` (the command line and the plan), ``sweep_setup``
(model, dtype, KV size), ``sweep_run`` (the driver: stacks, warm-up, points, the time
bounds), ``sweep_points`` (point files), ``trace_slices``, ``sweep_report`` and ``plots``.

A configuration that fails to start, or a point that fails, is recorded with its reason and
the sweep goes on. Must not import vLLM, NIXL or torch (servers and clients are child
processes).
"""

import contextlib
import json
import os
import platform
import shlex
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from connector.tools.bench import sweep_points, sweep_run, trace_slices
from connector.tools.bench.single import SINGLE, SINGLE_DESCRIPTION
from connector.tools.bench.stacks import CONFIGS, require_fronts
from connector.tools.bench.sweep_args import (
    DEFAULT_CONFIGS,
    SMOKE_CONFIGS,
    make_plan,
    parse_args,
)
from connector.tools.bench.sweep_run import STACK_START_ESTIMATE_S, estimate_minutes
from connector.tools.bench.sweep_setup import Log, Setup, resolve_dtype, resolve_model, server_args
from connector.tools.bench.vllm_bench import client_zygote, git_commit

CLIENT_LOG = "bench-client.log"


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
    require_fronts(configs)
    model, model_config = resolve_model(args.model or ("tiny" if args.smoke else "tiny-kv"))
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = (args.run_dir or Path("runs") / f"sweep-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    zygote = client_zygote(run_dir / CLIENT_LOG)  # started by the with below
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
        sweep_run.now() + args.max_minutes * 60.0,
        args.warmup if args.warmup is not None else not args.smoke,
        None if args.gpus is None else (args.gpus[0], args.gpus[1]),
        zygote,
    )
    meta = _meta(argv, setup, configs)
    todo = {
        n: [p for p in plan.points() if not sweep_points.is_done(run_dir, n, p)] for n in configs
    }
    total = sum(len(v) for v in todo.values())
    with zygote if total else contextlib.nullcontext(), _console(run_dir, total) as (log, advance):
        log(
            f"sweep {run_dir}: configs {configs}; lengths {plan.lengths}; rates {plan.rates}/s; "
            f"output {plan.output_len}; model {model.name}; {total} point(s) to run "
            f"({len(configs) * len(plan.points()) - total} done before); estimate "
            f"{estimate_minutes(plan, [n for n in configs if todo[n]]):.0f} min, "
            f"bound {args.max_minutes:g} min"
        )
        if args.interleave:
            log(f"interleaved: {', '.join(configs)} up at once, each point on all back to back")
            sweep_run.run_interleaved(configs, setup, todo, log, advance)
        else:
            for name in configs:
                if not todo[name]:
                    log(f"[{name}] every point done before: skipped")
                    continue
                if setup.deadline - sweep_run.now() < STACK_START_ESTIMATE_S:
                    log(f"[{name}] out of time before starting: left for a resumed run")
                    continue
                description = SINGLE_DESCRIPTION if name == SINGLE else CONFIGS[name].description
                log(f"[{name}] {description}")
                sweep_run.run_config(name, setup, todo[name], log, advance)
                if name != configs[-1]:  # each stack's points as they end; the PNG once, below
                    _publish(run_dir, meta, log, png=False)
        records = _publish(run_dir, meta, log)
    complete = {(r["config"], r["point"]) for r in records if r["ok"]}
    wanted = {(n, p.name) for n in configs for p in plan.points()}
    return 0 if wanted <= complete else 1


def _publish(
    run_dir: Path, meta: dict[str, Any], log: Log, png: bool = True
) -> list[dict[str, Any]]:
    """``sweep.json``, ``report.md`` and the figures from every point written so far (the
    PNG only with ``png``: its browser takes seconds to start)."""
    from connector.tools.bench import plots, sweep_report

    records = sweep_points.load_points(run_dir)
    data = sweep_points.write_sweep(run_dir, meta, records)
    (run_dir / "report.md").write_text(sweep_report.markdown(data))
    for line in plots.write_figures(run_dir, data, png):
        log(line)
    return records
