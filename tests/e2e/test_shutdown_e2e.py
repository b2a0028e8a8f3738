"""SIGTERM hands back what still waits: a transfer waiting at the signal ends with reason
``shutdown`` once ``shutdown_grace_s`` has passed, its peer told at once, and the server
exits when nothing is left instead of at vLLM's ``--shutdown-timeout`` (connector/shutdown.py,
docs/operations.md#shutting-down-p-or-d).

The servers are the shared 1 P + 2 D stack's (tests/e2e/shared_1p2d.py, vLLM with
``--shutdown-timeout 5``, D with ``kv_load_failure_policy: fail``); this test is its last user
(``stops_servers``): it stops D 0, then P, and restarts neither, so it costs no start of its own.

- D: a decode leg names P and a transfer id P is never given a prefill for, so D registers
  and waits (120 s by default). SIGTERM D: the request answers a clear error (vLLM's JSON 500
  for a failed load under ``fail``, which the router retries elsewhere) within the grace and
  a margin, D's ``await_kv`` span ends in error ``shutdown`` after the grace (not
  before it), and D exits because its drain ended, not at the timeout.
- P: a prefill leg sent to P alone (no D ever registers for it), so P holds its blocks for
  its lease (30 s). SIGTERM P: its ``rendezvous_wait`` span, emitted when P hands the blocks
  back, ends in error ``shutdown`` within the same bounds, and P exits because its drain ended.

Every server is stopped by ``VllmServer.stop`` (SIGTERM to its leader's PID, SIGKILL of its
group past the bound); the stack's teardown stops the rest.
"""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from typing import Any

import pytest

from bench.soak_report import clear_error
from connector.config import PushkvConfig
from connector.tools.hoststack import HostedServer, HostStack
from connector.tools.pdstack import metric_sum
from connector.tools.stack import SHUTDOWN_TIMEOUT_S
from telemetry.schema import Attr, Metric, Span
from tests.e2e.clients import http_client, wait_until
from tests.e2e.greedy import greedy_body
from tests.e2e.test_push_e2e import decode_leg, post_ok, random_prompt
from tests.e2e.test_tracing_e2e import attrs, is_error, traceparent, wait_for_spans

pytestmark = [pytest.mark.e2e, pytest.mark.stops_servers, pytest.mark.timeout(600)]

# What the servers run with: the config's default grace, capped at half vLLM's timeout.
GRACE_S = min(PushkvConfig().shutdown_grace_s, SHUTDOWN_TIMEOUT_S / 2)
# A waiting transfer ends at most this long after the grace: the signal reaches EngineCore
# through the API server's engine-client shutdown, the transfer thread wakes for the grace,
# and D then waits for P's answer to its cancel; the rest is a loaded 2-core box's
# scheduling. Grace + margin stays under vLLM's 5 s timeout, which ends what is left by
# killing the engine (no span then, and a later answer).
END_MARGIN_S = 2.8
EARLY_S = 0.05  # wall clocks of one host; the span may not end before the grace
STOP_BOUND_S = 12.0  # SIGTERM to exit, as the rolling restart's: vLLM's 5 s, its teardown
HTTP_TIMEOUT_S = 60.0
DRAIN_ENDED = "[shutdown] EngineCore: request processing complete"


def _gauge(url: str, metric: Metric) -> float:
    with http_client(url, 10) as c:
        return metric_sum(c.get("/metrics").text, metric.value) or 0.0


def _log_since(server: HostedServer, offset: int) -> str:
    with server.log.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def _stop(server: HostedServer) -> tuple[int, float]:
    """SIGTERM ``server`` (its leader); the wall-clock ns of the signal and the seconds it
    took to exit. Fails past ``STOP_BOUND_S``."""
    t_sig, t0 = time.time_ns(), time.monotonic()
    server.stop(2 * STOP_BOUND_S)  # SIGKILL of the group only past twice the bound
    took = time.monotonic() - t0
    assert took < STOP_BOUND_S, f"{server.log.name}: {took:.1f} s from SIGTERM to exit"
    return t_sig, took


def _ended_by_shutdown(span: dict[str, Any], t_sig: int, what: str) -> float:
    """``span`` ended in error ``shutdown``, not before the grace and at most END_MARGIN_S
    after it; its end in seconds after the signal."""
    assert is_error(span) and attrs(span)[Attr.REASON.value] == "shutdown", (
        f"{what}: {span['name']} should end with reason shutdown: {attrs(span)}"
    )
    after = (int(span["endTimeUnixNano"]) - t_sig) / 1e9
    assert GRACE_S - EARLY_S <= after <= GRACE_S + END_MARGIN_S, (
        f"{what}: {span['name']} ended {after:.2f} s after SIGTERM (grace {GRACE_S} s, "
        f"bound grace + {END_MARGIN_S} s)"
    )
    return after


def _span(run_dir: Any, trace_id: str, name: Span) -> dict[str, Any]:
    got = wait_for_spans(run_dir, {trace_id: 1})[trace_id]
    spans = [s for s in got if s["name"] == name.value]
    if not spans:  # the others of the trace came first: wait for this one too
        got = wait_for_spans(run_dir, {trace_id: len(got) + 1})[trace_id]
        spans = [s for s in got if s["name"] == name.value]
    assert spans, f"no {name.value} span in trace {trace_id}: {[s['name'] for s in got]}"
    return spans[0]


def _probe(url: str) -> dict[str, Any]:
    with http_client(url, HTTP_TIMEOUT_S) as c:
        body = {"model": "tiny", "prompt": "probe", "max_tokens": 1}
        out = post_ok(c, "/v1/completions", {**body, "kv_transfer_params": {"pushkv_probe": True}})
    coords: dict[str, Any] = out["kv_transfer_params"]["pushkv"]
    return coords


def test_sigterm_hands_back_waiting_transfers_on_d_then_p(one_p_two_d: HostStack) -> None:
    stack = one_p_two_d
    p, d = stack.prefills[0], stack.decodes[0]
    coords = _probe(p.url)
    notes = []

    # --- D: registered, waiting for a P that is never given the prefill.
    trace_id, _, header = traceparent()
    leg = decode_leg(coords, uuid.uuid4().hex, traceparent=header)
    body = greedy_body(random_prompt(64, seed=3100), kv_transfer_params=leg)
    offset = d.log.stat().st_size
    with (
        http_client(d.url, HTTP_TIMEOUT_S) as c,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        sent = pool.submit(lambda: (c.post("/v1/completions", json=body), time.time_ns()))
        wait_until("D waiting for its KV", lambda: _gauge(d.url, Metric.AWAITING_KV) >= 1, 60, 0.2)
        t_sig, took = _stop(d)
        resp, answered = sent.result(timeout=HTTP_TIMEOUT_S)
    after = (answered - t_sig) / 1e9
    print(f"\n[shutdown] D: {resp.status_code} {resp.text[:200]!r} {after:.2f} s after SIGTERM")
    assert after <= GRACE_S + END_MARGIN_S, (
        f"D answered {after:.2f} s after SIGTERM (bound: grace {GRACE_S} + {END_MARGIN_S} s)"
    )
    assert resp.status_code != 200 and clear_error(resp), (
        f"D (kv_load_failure_policy fail) should answer a clear error for a load that "
        f"failed at shutdown: {resp.status_code} {resp.text[:300]}"
    )
    span_after = _ended_by_shutdown(_span(stack.run_dir, trace_id, Span.AWAIT_KV), t_sig, "D")
    assert DRAIN_ENDED in _log_since(d, offset), f"D's drain never ended; see {d.log}"
    notes.append(
        f"D: answered +{after:.2f} s, await_kv ended +{span_after:.2f} s, exit {took:.1f} s"
    )

    # --- P: a prefill whose D never registers; P holds its blocks for its lease.
    trace_id, _, header = traceparent()
    p_leg = {"do_remote_decode": True, "transfer_id": uuid.uuid4().hex, "traceparent": header}
    with http_client(p.url, HTTP_TIMEOUT_S) as c:
        prompt = random_prompt(64, seed=3200)
        post_ok(
            c, "/v1/completions", {**greedy_body(prompt, max_tokens=1), "kv_transfer_params": p_leg}
        )
    wait_until("P holding the blocks", lambda: _gauge(p.url, Metric.BLOCKS_HELD) > 0, 30, 0.2)
    offset = p.log.stat().st_size
    t_sig, took = _stop(p)
    span = _span(stack.run_dir, trace_id, Span.RENDEZVOUS_WAIT)
    span_after = _ended_by_shutdown(span, t_sig, "P")
    assert DRAIN_ENDED in _log_since(p, offset), (
        f"P's drain never ended (blocks kept until vLLM's timeout?); see {p.log}"
    )
    notes.append(f"P: rendezvous_wait ended +{span_after:.2f} s, exit {took:.1f} s")
    print("[shutdown] " + "; ".join(notes))
