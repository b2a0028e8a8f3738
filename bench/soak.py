"""Soak: many requests through a real P/D stack, random client aborts, one P crash and restart.

Starts P, D and the router on the tiny model (``connector.tools.pdstack``, short deadlines),
computes each of ``--prompts`` prompts' single-instance answer on D (no KV transfer, a fresh
``cache_salt``), then sends ``--requests`` requests at ``--concurrency``, each a random one
of those prompts; a share ``--stream-share`` of them (spread evenly) asks for ``stream: true``
(SSE), and a random share ``--abort-rate`` gives up after a random 10-500 ms (the client
disconnects mid-prefill or mid-decode). When ``--restart-at`` of them were sent, P is
killed (SIGKILL of its process group) and started again under the same engine id; the next
``--down-share`` are sent while P is down (D alone serves them), and the rest only once the
restarted P answers ``/health``, so the run ends on P/D with the restarted P.

Prints one report and writes it as JSON to ``<run-dir>/soak.json``. It fails (exit 1)
unless: no request hung (each ended within ``--request-timeout``); every completed answer
agrees with the single instance's by the end-to-end tests' rule (``tests/e2e/greedy.py``:
tokens equal but past a near-tie, logprobs within its tolerance), a stream's events added up;
every failed one is a clear error (JSON with a message, never a bare 500; or an error event
ending a stream, never a stream cut short or one that ends with ``[DONE]`` but is not
whole); every request in flight at the kill or started soon after it ended within
``KILL_END_BOUND_S`` of the kill; the restarted P was sent a leg again soon after its
``/health`` answered; both servers' KV cache is back to idle.

    python -m bench.soak                      # 2,000 requests, 16 at a time (`make soak`)
    python -m bench.soak --requests 200       # a quick one

``run(Options(...), run_dir)`` does the same from a test (tests/e2e/test_soak_e2e.py) and
returns the ``Report``, its ``problems`` filled.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench.soak_report import Options, Report, Sent, check, judge, judge_stream, latencies
from bench.soak_stream import post_stream
from connector.tools.pdstack import PdStack, metric_sum
from connector.tools.tinymodel import make_tiny_model
from tests.e2e.greedy import greedy_body

__all__ = ["Options", "Report", "main", "run"]

VOCAB = (3, 4096)
KV_USAGE = "vllm:kv_cache_usage_perc"
P_CONFIG = {"lease_s": 10.0, "write_timeout_s": 2.0}
D_CONFIG = {"receive_timeout_s": 10.0, "write_timeout_s": 2.0, "grace_s": 2.0}
WARM_UP_PROMPT = [7] * 20


def kv_usage(client: httpx.Client) -> float | None:
    try:
        return metric_sum(client.get("/metrics").text, KV_USAGE)
    except httpx.HTTPError:
        return None


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
    except OSError:
        return ""
    return out.stdout.strip()


def _client(url: str, timeout_s: float) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=timeout_s, trust_env=False)


def run(options: Options, run_dir: Path, model: Path | None = None) -> Report:
    """Start the stack, soak it, stop it (every process by its PID); the report, checked."""
    rng = random.Random(options.seed)
    stack = PdStack(
        model or make_tiny_model(),
        run_dir,
        prefill_extra_config=P_CONFIG,
        decode_extra_config=D_CONFIG,
        tracing=False,
    )
    report = Report(options, _commit())
    try:
        stack.start(options.start_timeout_s)
        print(f"stack healthy after {stack.start_duration_s:.0f} s\n{stack.describe()}", flush=True)
        prompts = [
            [rng.randrange(*VOCAB) for _ in range(rng.randrange(16, 600))]
            for _ in range(options.prompts)
        ]
        with _client(stack.decode.url, 60) as d, _client(stack.url, 60) as router:
            for c in (router, d):  # first requests (logprobs, each path) take seconds
                c.post("/v1/completions", json=greedy_body(WARM_UP_PROMPT)).raise_for_status()
            refs = []
            for p in prompts:
                r = d.post("/v1/completions", json=greedy_body(p, cache_salt=uuid.uuid4().hex))
                r.raise_for_status()
                refs.append(r.json())
        print(f"{len(refs)} references computed", flush=True)
        soak(stack, options, rng, prompts, refs, report)
    finally:
        stack.stop()
    check(report)
    return report


def _legs_to_p(router: httpx.Client) -> int:
    n: int = router.get("/router/stats").json()["prefill"][0]["dispatched"]
    return n


class _Restarter(threading.Thread):
    """Kills P when told to, starts it again, and times its way back into rotation."""

    def __init__(self, stack: PdStack, options: Options, report: Report, t0: float) -> None:
        super().__init__(daemon=True)
        self.stack, self.options, self.report, self.t0 = stack, options, report, t0
        self.kill_now = threading.Event()
        self.p_back = threading.Event()  # set once P answers /health again (or gave up)
        self.killed_s: float | None = None  # seconds since the soak began
        self.back_s: float | None = None  # when the restarted P answered /health
        self.abandoned = False  # the soak failed: start nothing more (stack.stop() follows)
        self._lock = threading.Lock()

    def abandon(self) -> None:
        """No kill or restart from now on; releases every request waiting for P."""
        with self._lock:
            self.abandoned = True
        self.kill_now.set()
        self.p_back.set()

    def run(self) -> None:
        self.kill_now.wait()
        p, info = self.stack.prefill, self.report.p_restart
        try:
            with self._lock:  # a started P is registered before stack.stop() can run
                if self.abandoned:
                    return
                self.killed_s = time.monotonic() - self.t0
                p.kill()  # SIGKILL of P's whole process group, by its PID
                info["killed_at_s"] = round(self.killed_s, 2)
                p.log_path = self.stack.run_dir / "prefill-restarted.log"  # keep the killed log
                p.start()
            p.wait_healthy(self.options.start_timeout_s)
            healthy = time.monotonic()
            self.back_s = healthy - self.t0
            info["healthy_after_kill_s"] = round(self.back_s - self.killed_s, 1)
            with _client(self.stack.url, 10) as router:
                at_health = _legs_to_p(router)
                self.p_back.set()
                deadline = healthy + 60
                while _legs_to_p(router) == at_health and time.monotonic() < deadline:
                    time.sleep(0.05)  # pacing of the poll, not synchronisation
                if _legs_to_p(router) > at_health:
                    info["used_again_after_health_s"] = round(time.monotonic() - healthy, 2)
        finally:
            self.p_back.set()
        print(f"P back: {info}", flush=True)


def soak(
    stack: PdStack,
    options: Options,
    rng: random.Random,
    prompts: list[list[int]],
    refs: list[dict[str, Any]],
    report: Report,
) -> None:
    n = options.requests
    kill_index = int(n * options.restart_at)
    resume_index = kill_index + int(n * options.down_share)
    # Streams are spread evenly, not drawn: every stretch of the run has its share of them,
    # the requests in flight at the kill included.
    share = options.stream_share
    plan = [
        (
            rng.randrange(len(prompts)),
            rng.random() < options.abort_rate,
            rng.uniform(0.01, 0.5),
            int((i + 1) * share) > int(i * share),
        )
        for i in range(n)
    ]
    lock = threading.Lock()
    records: list[Sent] = []
    clients: list[httpx.Client] = []
    local = threading.local()
    t_start = time.monotonic()
    restarter = _Restarter(stack, options, report, t_start)

    def client() -> httpx.Client:
        if not hasattr(local, "c"):
            local.c = _client(stack.url, options.request_timeout_s)
            with lock:
                clients.append(local.c)
        c: httpx.Client = local.c
        return c

    def one(i: int) -> None:
        k, abort, patience, stream = plan[i]
        if i == kill_index:
            restarter.kill_now.set()
        if i >= resume_index and not restarter.p_back.wait(options.start_timeout_s + 60):
            raise TimeoutError(f"request {i}: P neither came back nor gave up")
        if restarter.abandoned:
            return  # the soak failed elsewhere: not sent
        t0 = time.monotonic()
        timeout = patience if abort else options.request_timeout_s
        what = f"request {i} (prompt {k}{', streamed' if stream else ''})"
        body = greedy_body(prompts[k])
        try:
            if stream:
                read = post_stream(client(), body, timeout)
            else:
                resp = client().post("/v1/completions", json=body, timeout=timeout)
        except httpx.TimeoutException:
            outcome = "aborted" if abort else "hung"
        except httpx.HTTPError as exc:
            outcome = "transport_error"
            with lock:
                report.errors[f"client: {exc!r}"[:160]] += 1
        else:
            if stream:
                outcome = judge_stream(read, refs[k], what, report, lock)
            else:
                outcome = judge(resp, refs[k], what, report, lock)
        took = Sent(i, abort, stream, t0 - t_start, time.monotonic() - t_start, outcome)
        with lock:
            report.outcomes[outcome] += 1
            if stream:
                report.stream_outcomes[outcome] += 1
            records.append(took)

    restarter.start()
    pool = concurrent.futures.ThreadPoolExecutor(options.concurrency)
    try:
        for f in [pool.submit(one, i) for i in range(n)]:
            f.result()
    except BaseException:  # e.g. pytest-timeout: requests not started yet are not sent
        restarter.abandon()
        raise
    finally:
        pool.shutdown(cancel_futures=True)
        for c in clients:
            c.close()
    restarter.join(timeout=options.start_timeout_s + 90)  # it was told: kill_index < n
    if restarter.is_alive():
        raise TimeoutError("P's restart still running after the last request")
    report.seconds = round(time.monotonic() - t_start, 1)
    latencies(records, restarter.killed_s, restarter.back_s, report)
    idle(stack, report)


def idle(stack: PdStack, report: Report, timeout_s: float = 120.0) -> None:
    """Wait (bounded) until both servers' KV cache usage is 0; record how long it took."""
    t0 = time.monotonic()
    with _client(stack.prefill.url, 10) as p, _client(stack.decode.url, 10) as d:
        while True:
            usage = {"prefill": kv_usage(p), "decode": kv_usage(d)}
            if all(u == 0.0 for u in usage.values()):
                report.idle_after_s = round(time.monotonic() - t0, 1)
                break
            if time.monotonic() - t0 > timeout_s:
                break
            time.sleep(0.5)  # pacing of the poll, not synchronisation
    report.kv_usage_after = usage


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Options()
    ap.add_argument("--requests", type=int, default=d.requests)
    ap.add_argument("--concurrency", type=int, default=d.concurrency)
    ap.add_argument("--abort-rate", type=float, default=d.abort_rate)
    ap.add_argument(
        "--stream-share", type=float, default=d.stream_share, help="share sent with stream: true"
    )
    ap.add_argument(
        "--restart-at", type=float, default=d.restart_at, help="share sent before P's crash"
    )
    ap.add_argument(
        "--down-share", type=float, default=d.down_share, help="share sent while P is down"
    )
    ap.add_argument("--prompts", type=int, default=d.prompts)
    ap.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--run-dir", default=f"runs/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    options = Options(
        requests=args.requests,
        concurrency=args.concurrency,
        abort_rate=args.abort_rate,
        stream_share=args.stream_share,
        restart_at=args.restart_at,
        down_share=args.down_share,
        prompts=args.prompts,
        request_timeout_s=args.request_timeout,
        seed=args.seed,
    )
    report = run(options, Path(args.run_dir))
    out = json.dumps(report.as_json(), indent=2)
    Path(args.run_dir, "soak.json").write_text(out + "\n")
    print(out)
    print("PASS" if not report.problems else "FAIL: " + "\n".join(report.problems))
    return 0 if not report.problems else 1


if __name__ == "__main__":
    sys.exit(main())
