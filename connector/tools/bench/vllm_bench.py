"""Running the real ``vllm bench serve`` against one endpoint, for the push-vs-pull benchmark.

Owns: ``Workload`` (random prompts of fixed lengths, the concurrency levels and their prompt
counts, the seeds), the ``vllm bench serve`` command line (``bench_command``), running it
with a wall-clock limit and killing its process group when it hangs (``run_bench_serve``),
and reading D's prompt tokens by source from ``/metrics`` (``decode_prompt_tokens``), which
shows whether D took the KV from P or recomputed it.

Must not import vLLM (``vllm bench serve`` is a child process). Needs httpx.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from connector.tools.bench.client_zygote import CLIENT_PRIORITY, SCHED_CLASS, ClientZygote
from connector.tools.pdstack import metric_sum
from connector.tools.stack import stop_process_group, tail_lines

SOURCE_METRIC = "vllm:prompt_tokens_by_source_total"
SOURCES = ("external_kv_transfer", "local_compute", "local_cache_hit")


@dataclass(frozen=True)
class Workload:
    """What ``vllm bench serve`` sends: random prompts, fixed lengths, at each level
    (``levels``: (max concurrency, number of prompts)). ``request_rate`` None: closed loop
    (a client sends its next request when its last one ends, so a faster stack is offered
    more load); a number: open loop, Poisson arrivals at that many requests/s on average,
    still capped at the level's concurrency, so every stack is offered the same load."""

    input_len: int = 256
    output_len: int = 32
    # Long enough for a steady state: in a short level the closed loop's ramp-up and tail
    # weigh as much as the rest.
    levels: tuple[tuple[int, int], ...] = ((4, 160), (16, 480))
    warmup_prompts: int = 8
    warmup_concurrency: int = 4
    seed: int = 0
    request_rate: float | None = None

    def level_seed(self, index: int) -> int:
        return self.seed + index

    def limit_s(self, num_prompts: int) -> float:
        """Wall-clock limit of one run: room for the client's start-up and, many times over,
        for every request of a healthy stack; it bounds a hung connector."""
        return 90.0 + 2.0 * num_prompts


def vllm_command() -> list[str]:
    """``vllm`` run by this interpreter: no console script needed on PATH or beside it."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def bench_command(
    base_url: str,
    model_dir: Path,
    workload: Workload,
    concurrency: int,
    num_prompts: int,
    seed: int,
    result: Path | None,
    request_id_prefix: str | None = None,
) -> list[str]:
    """The ``vllm bench serve`` command line; ``result`` None: do not save (warm-up).
    ``request_id_prefix``: the client sends ``<prefix><index>`` as each request's
    X-Request-Id, so its TTFTs can be matched to the traces (``bench.fidelity``)."""
    cmd = [
        *vllm_command(),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        "tiny",
        "--tokenizer",
        str(model_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(workload.input_len),
        "--random-output-len",
        str(workload.output_len),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--disable-tqdm",
    ]
    if workload.request_rate is not None and result is not None:  # the warm-up: closed loop
        cmd += ["--request-rate", f"{workload.request_rate:g}"]
    if request_id_prefix is not None:
        cmd += ["--request-id-prefix", request_id_prefix]
    if result is not None and workload.request_rate is None:
        # Closed loop: one unmeasured request per client first, so the run starts with its
        # connections open, as a steady state has them; else the first request of each
        # client also times the client opening its connection, one after another, which no
        # span sees (docs/benchmarks.md, "Trace fidelity and the router").
        cmd += ["--num-warmups", str(concurrency)]
    if result is not None:
        cmd += [
            "--save-result",
            "--save-detailed",
            "--result-dir",
            str(result.parent),
            "--result-filename",
            result.name,
        ]
    return cmd


def bench_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }
    )
    return env


@dataclass(frozen=True)
class RunFailure:
    """Why one ``vllm bench serve`` run gave no numbers; ``hung``: killed at its limit."""

    reason: str
    hung: bool = False


def client_zygote(log_path: Path) -> ClientZygote:
    """What ``run_bench_serve`` runs its command lines in when given one: forks of a process
    that imported vLLM once (its own log at ``log_path``), instead of a fresh process each."""
    return ClientZygote(log_path, bench_env())


def _prioritized() -> None:
    """In the client's child, before exec: SCHED_FIFO where allowed. The client measures;
    queued behind the engines for a core it would time its own wait (on two cores both
    running engines, 2-3 ms per request: ``connector/router/priority.py``)."""
    with contextlib.suppress(OSError):  # not root: the normal class, and the log says so
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(CLIENT_PRIORITY))


def run_bench_serve(
    cmd: Sequence[str], log_path: Path, limit_s: float, zygote: ClientZygote | None = None
) -> RunFailure | None:
    """Run ``cmd`` in its own session (or in a fork of ``zygote``), output to ``log_path``;
    None on success, else why not (exit code, or still running at ``limit_s`` and then killed
    by process group)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
    if zygote is not None and zygote.accepts(cmd):
        return _failure(zygote.run(cmd, log_path, limit_s), log_path, limit_s)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            list(cmd),
            env=bench_env(),
            cwd=log_path.parent,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_prioritized if hasattr(os, "sched_setscheduler") else None,
        )
        if hasattr(os, "sched_getscheduler"):
            with contextlib.suppress(OSError):  # it may have exited already
                policy = os.sched_getscheduler(proc.pid)
                name = SCHED_CLASS.get(policy, policy)
                log.write(f"# client scheduling class: {name}\n".encode())
                log.flush()
        try:
            rc: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            stop_process_group(proc, 10.0)
            rc = None
        except BaseException:
            stop_process_group(proc, 10.0)
            raise
    return _failure(rc, log_path, limit_s)


def _failure(rc: int | None, log_path: Path, limit_s: float) -> RunFailure | None:
    """What a run's exit status says (None: killed at ``limit_s``)."""
    if rc is None:
        return RunFailure(
            f"vllm bench serve hung: still running after {limit_s:.0f} s, killed", hung=True
        )
    if rc != 0:
        last = tail_lines(log_path, 3).strip().splitlines()
        return RunFailure(f"vllm bench serve exited {rc}: {last[-1] if last else ''}")
    return None


def decode_prompt_tokens(url: str) -> dict[str, float]:
    """D's cumulative prompt tokens by source ({} if /metrics cannot be read)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5.0, trust_env=False).text
    except httpx.HTTPError:
        return {}
    return {src: metric_sum(text, SOURCE_METRIC, source=src) or 0.0 for src in SOURCES}


def git_commit() -> str | None:
    """The checkout's commit; ``PUSHKV_COMMIT`` where the copy's git HEAD is not it (the GPU
    machine's copy of the working tree: scripts/gpu/run.sh)."""
    if os.environ.get("PUSHKV_COMMIT"):
        return os.environ["PUSHKV_COMMIT"]
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or None
