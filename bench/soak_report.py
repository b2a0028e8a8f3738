"""What a soak (``bench.soak``) measured and which of its promises broke: the run's options,
each request as the client saw it, the report, and the checks that fill ``Report.problems``
(no request hung; answers, streamed ones too, agree with the single instance by
``tests/e2e/greedy.py``'s rule; failures are clear errors: a JSON error with a message, or an
error event ending a stream, never a stream cut short or one that looks complete but is not;
requests around P's kill end within ``KILL_END_BOUND_S``; the restarted P is used again
within ``REUSE_BOUND_S`` of its ``/health``; the KV cache idles).
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import httpx

from bench.soak_stream import StreamRead
from tests.e2e.greedy import MAX_TOKENS, assert_matches_reference

_IDS = re.compile(r"[0-9a-f]{32}")  # transfer and request ids: errors group by their text
# The requests "around the kill": in flight at it, or started this soon after it (as in
# tests/e2e/test_failover_e2e.py, AROUND_S).
AROUND_S = 3.0
# Each of them must end within this of the kill: the last starts at +3 s, gets the failover
# test's bound (3 s plus its own normal time), and 4 s more because P's import-heavy restart
# begins at the kill on the same 2 cores (measured by `python -m bench.soak`; a head-of-line
# stall, the failure this guards, takes far longer).
KILL_END_BOUND_S = 10.0
# The restarted P is sent a leg again this soon after its /health answers (the router
# rechecks a backend out of service every 0.5 s), plus 2 s for a loaded box.
REUSE_BOUND_S = 7.0


@dataclass(frozen=True)
class Options:
    requests: int = 2000
    concurrency: int = 16
    abort_rate: float = 0.1
    stream_share: float = 0.25  # share sent with stream: true (SSE), spread evenly
    restart_at: float = 0.5  # share sent before P's kill
    down_share: float = 0.25  # share sent while P is down; the rest waits for its restart
    prompts: int = 64
    request_timeout_s: float = 120.0  # a request still unanswered after this has hung
    start_timeout_s: float = 300.0  # the stack's start, and P's restart
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1 or not 0 <= self.restart_at < 1 or self.down_share < 0:
            raise ValueError(f"P must be killed during the run: {self}")
        if self.restart_at + self.down_share > 1:
            raise ValueError(f"restart_at + down_share is over 1: {self}")
        if not 0 <= self.stream_share <= 1:
            raise ValueError(f"stream_share is not a share: {self}")


@dataclass
class Sent:
    """One request as the client saw it (times in seconds since the soak began)."""

    index: int
    abort: bool
    stream: bool
    started_s: float
    ended_s: float
    outcome: str  # ok, aborted, hung, mismatch, error, unclear_error, transport_error


@dataclass
class Report:
    options: Options
    commit: str = ""
    outcomes: Counter[str] = field(default_factory=Counter)
    stream_outcomes: Counter[str] = field(default_factory=Counter)  # the streamed ones
    errors: Counter[str] = field(default_factory=Counter)  # "status: message" of failed ones
    mismatches: list[str] = field(default_factory=list)
    near_tie_parts: int = 0  # answers parting from the reference at a near-tie (allowed)
    p_restart: dict[str, float] = field(default_factory=dict)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)  # by start: kill, back
    around_kill: dict[str, float] = field(default_factory=dict)
    late_around_kill: list[str] = field(default_factory=list)
    seconds: float = 0.0
    idle_after_s: float | None = None
    kv_usage_after: dict[str, float | None] = field(default_factory=dict)
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    latency_max_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["options"] = asdict(self.options)
        return out


def clear_error(resp: httpx.Response) -> str | None:
    """The error's message if the answer is a clear one (JSON with a message), else None."""
    try:
        err = resp.json().get("error")
    except ValueError:
        return None
    msg = err.get("message") if isinstance(err, dict) else err
    return str(msg) if msg else None


def _agrees(
    out: dict[str, Any], ref: dict[str, Any], what: str, report: Report, lock: threading.Lock
) -> str:
    """ok, or mismatch: ``out`` against the single instance's ``ref``."""
    try:
        agree = assert_matches_reference(out, ref, what)
    except (AssertionError, KeyError, ValueError) as exc:
        with lock:
            report.mismatches.append(f"{what}: {exc}"[:400])
        return "mismatch"
    if agree < MAX_TOKENS:
        with lock:
            report.near_tie_parts += 1
    return "ok"


def _failed(report: Report, lock: threading.Lock, key: str, clear: bool) -> str:
    with lock:
        report.errors[_IDS.sub("*", key)] += 1
    return "error" if clear else "unclear_error"


def judge(
    resp: httpx.Response, ref: dict[str, Any], what: str, report: Report, lock: threading.Lock
) -> str:
    """One answer's outcome: ok, mismatch (against the single instance), error (a clear
    one: JSON with a message, not a 500) or unclear_error."""
    if resp.status_code == 200:
        try:
            out = resp.json()
        except ValueError as exc:
            with lock:
                report.mismatches.append(f"{what}: not JSON: {exc}"[:400])
            return "mismatch"
        return _agrees(out, ref, what, report, lock)
    msg = clear_error(resp)
    key = f"{resp.status_code}: {(msg or resp.text)[:160]}"
    return _failed(report, lock, key, bool(msg) and resp.status_code != 500)


def judge_stream(
    read: StreamRead, ref: dict[str, Any], what: str, report: Report, lock: threading.Lock
) -> str:
    """A streamed answer's outcome, by the same rules: a status other than 200 as ``judge``
    says; an error event is a clear error; a stream cut with neither ``[DONE]`` nor an error
    event, or with events that are not JSON, is not; one that ended with ``[DONE]`` must add
    up to the single instance's answer (a truncated one that looks complete is a mismatch)."""
    if read.response.status_code != 200:
        return judge(read.response, ref, what, report, lock)
    if read.error is not None:
        return _failed(report, lock, f"stream: {read.error[:160]}", True)
    if not read.done or read.garbled:
        key = f"stream: cut without [DONE] or an error event ({read.garbled} garbled events)"
        return _failed(report, lock, key, False)
    if read.finish_reason is None:
        with lock:
            report.mismatches.append(f"{what}: stream ended with no finish_reason")
        return "mismatch"
    return _agrees(read.completion(), ref, what, report, lock)


def _percentiles(took: list[float]) -> dict[str, float]:
    took = sorted(took)
    if not took:
        return {"requests": 0}
    p50, p99 = took[len(took) // 2], took[int(len(took) * 0.99)]
    return {
        "requests": len(took),
        "p50_s": round(p50, 3),
        "p99_s": round(p99, 3),
        "max_s": round(took[-1], 3),
    }


def latencies(
    records: list[Sent], killed_s: float | None, back_s: float | None, report: Report
) -> None:
    """Percentiles of the requests that did not abort (overall, and by when they started:
    before the kill, while P was down, after its restart), and the ones around the kill."""
    full = [r for r in records if not r.abort and r.outcome != "hung"]
    overall = _percentiles([r.ended_s - r.started_s for r in full])
    report.latency_p50_s = overall.get("p50_s", 0.0)
    report.latency_p99_s = overall.get("p99_s", 0.0)
    report.latency_max_s = overall.get("max_s", 0.0)
    if killed_s is None:
        return
    back = back_s if back_s is not None else float("inf")
    spans = {"before_kill": (0.0, killed_s), "p_down": (killed_s, back), "p_back": (back, 1e9)}
    report.phases = {
        name: _percentiles([r.ended_s - r.started_s for r in full if lo <= r.started_s < hi])
        for name, (lo, hi) in spans.items()
    }
    before = [r.ended_s - r.started_s for r in full if r.ended_s < killed_s]
    around = [
        r
        for r in records
        if not r.abort and r.ended_s > killed_s and r.started_s < killed_s + AROUND_S
    ]
    report.around_kill = {
        "requests": len(around),
        "streams": sum(r.stream for r in around),
        "streams_in_flight": sum(r.stream and r.started_s < killed_s for r in around),
        "baseline_slowest_s": round(max(before, default=0.0), 3),
        "longest_s": round(max((r.ended_s - r.started_s for r in around), default=0.0), 3),
        "last_end_after_kill_s": round(max((r.ended_s - killed_s for r in around), default=0), 3),
        "bound_s": KILL_END_BOUND_S,
    }
    report.late_around_kill = [
        f"request {r.index} ({r.outcome}): started {r.started_s - killed_s:+.2f} s, "
        f"ended {r.ended_s - killed_s:+.2f} s from the kill"
        for r in around
        if r.ended_s - killed_s > KILL_END_BOUND_S
    ]


def check(report: Report) -> None:
    """Fill ``report.problems``: each names the broken promise and its evidence."""
    o, p = report.outcomes, report.problems
    if o["hung"]:
        p.append(
            f"{o['hung']} requests hung (no answer within {report.options.request_timeout_s} s)"
        )
    if o["mismatch"]:
        p.append(
            f"{o['mismatch']} answers differ from the single instance: {report.mismatches[:3]}"
        )
    if o["unclear_error"] or o["transport_error"]:
        p.append(f"failed requests without a clear error: {dict(report.errors)}")
    if report.idle_after_s is None:
        p.append(f"KV cache not idle afterwards: {report.kv_usage_after}")
    if sum(o.values()) != report.options.requests:
        p.append(f"{report.options.requests - sum(o.values())} requests unaccounted for")
    if "killed_at_s" not in report.p_restart:
        p.append("P was never killed")
    elif "healthy_after_kill_s" not in report.p_restart:
        p.append(f"P did not come back within {report.options.start_timeout_s} s of its restart")
    elif report.p_restart.get("used_again_after_health_s", float("inf")) > REUSE_BOUND_S:
        p.append(
            f"the restarted P was not sent a leg within {REUSE_BOUND_S} s of its /health: "
            f"{report.p_restart}"
        )
    if report.late_around_kill:
        p.append(
            f"{len(report.late_around_kill)} requests around the kill ended more than "
            f"{KILL_END_BOUND_S} s after it: {report.late_around_kill[:5]}"
        )
