"""One configuration of the serving benchmark (``pushkv bench``), start to stop.

Owns ``run_config``: start the stack on free ports, warm up, one ``vllm bench serve`` run per
concurrency level, stop by process group and check that the processes and ports are gone;
then each level's client TTFTs against the router's traces (``fidelity``) and the log
signals counted per stack. A configuration that fails (start-up, warm-up, a hang past the
limit) comes back as failed levels carrying the reason; it never raises.

Must not import vLLM, NIXL or torch: everything vLLM runs in child processes.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from connector.tools.bench import fidelity
from connector.tools.bench.level_result import LevelResult
from connector.tools.bench.stacks import (
    NOPROG_MARKER,
    BenchConfig,
    BenchStack,
    make_stack,
    on_free_ports,
    other_vllm_pids,
    stop_and_check,
)
from connector.tools.bench.vllm_bench import (
    RunFailure,
    Workload,
    bench_command,
    decode_prompt_tokens,
    run_bench_serve,
)
from connector.tools.stack import ServerError, group_pids
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
