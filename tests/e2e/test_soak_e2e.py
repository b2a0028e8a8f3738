"""The soak as a test, short form: a few hundred requests through P, D and the
router on the tiny model, a quarter of them streamed (SSE), with random client aborts and one
kill -9 of P and its restart.

``bench.soak.run`` does the work (``make soak`` is the long form, 2,000 requests) and
returns its report with every broken promise in ``problems``: a hung request (a stream too:
bounded in all, not per read), an answer that disagrees with the single instance
(``tests/e2e/greedy.py``'s rule; a stream's events added up), a failure that is not a clear
error (a stream may fail only with an error event, never cut short or ending with ``[DONE]``
while not whole), a request around the kill that ended more than ``KILL_END_BOUND_S`` after it,
a restarted P not used again, KV still in use afterwards. The stack (P, D, the router, and
the restarted P) is stopped by ``PdStack.stop``, each process group by its leader's PID.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import soak

# Two vLLM start-ups (the stack, then P's restart) each bounded by Options.start_timeout_s
# (300 s, the e2e stacks' bound: a loaded 2-core box took 2 min for the first), plus the
# references and the soak itself: the bound only ends a stuck run, as test_failover_e2e's.
pytestmark = [pytest.mark.e2e, pytest.mark.soak, pytest.mark.timeout(900)]

SHORT = soak.Options(
    requests=240,
    concurrency=8,
    abort_rate=0.1,
    stream_share=0.25,
    prompts=24,
    request_timeout_s=60.0,
)


def test_short_soak_with_aborts_and_a_p_restart_keeps_every_promise(
    tiny_model: Path, e2e_log_dir: Path
) -> None:
    report = soak.run(SHORT, e2e_log_dir / "soak", tiny_model)
    print(
        f"\n[soak] {dict(report.outcomes)} (streamed: {dict(report.stream_outcomes)}) in "
        f"{report.seconds} s; latency p50 "
        f"{report.latency_p50_s} s, p99 {report.latency_p99_s} s, max "
        f"{report.latency_max_s} s; around the kill {report.around_kill}; P {report.p_restart}; "
        f"near-tie parts {report.near_tie_parts}; errors {dict(report.errors)}; idle after "
        f"{report.idle_after_s} s"
    )
    assert not report.problems, "the soak broke its promises:\n" + "\n".join(report.problems)
    assert report.around_kill["requests"] > 0, "no request was in flight around P's kill"
    assert report.around_kill["streams_in_flight"] > 0, (
        f"no stream in flight at P's kill: {report.around_kill}"
    )
    assert report.stream_outcomes["ok"] > 0, f"no stream answered: {report.stream_outcomes}"
    answered = report.outcomes["ok"] + report.outcomes["error"]
    assert report.outcomes["ok"] >= 0.9 * answered, (
        f"fewer than 90 % of the answered requests succeeded: {dict(report.outcomes)}, "
        f"errors {dict(report.errors)}"
    )
