"""A push request's transfer as its spans tell it: traced requests, their P-side and D-side
transfer spans, and the KV geometry P's spans carry. Test code only; imports no vLLM.

Owns: ``traced_completion`` (a request with a trace id of its own), ``transfer_trace``
(waits for the spans of one push transfer), ``assert_kv_geometry`` (every
``prepare_descriptors`` and ``write`` span names the model's KV as ``want`` says) and the
servers' own transfer counts (``done_transfers``, ``wait_for_transfers``).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from connector.tools.pdstack import metric_sum
from telemetry.otlp_json import Trace
from telemetry.schema import Attr, Metric, Span
from telemetry.traces import read_run

SPAN_WAIT_S = 30.0  # the exporters flush every 0.5 s; a loaded box may take longer
METRIC_SETTLE_S = 10.0
HTTP_TIMEOUT_S = 60.0


def traced_completion(client: httpx.Client, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """POST ``/v1/completions`` under a client traceparent of its own: (trace id, answer)."""
    trace_id = uuid.uuid4().hex
    header = f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"
    resp = client.post("/v1/completions", json=body, headers={"traceparent": header})
    assert resp.status_code == 200, f"{client.base_url}: {resp.status_code} {resp.text}"
    out: dict[str, Any] = resp.json()
    return trace_id, out


def transfer_trace(run_dir: Path, trace_id: str, d_ranks: int = 1, writes: int = 1) -> Trace:
    """The trace once it holds one ``await_kv`` per D rank and ``writes`` of P's ``write``
    spans (one per writing P rank: TP rank, and stage where P runs several) (bounded)."""
    deadline = time.monotonic() + SPAN_WAIT_S
    while True:
        trace = read_run(run_dir).trace(trace_id)
        if trace is not None:
            awaits, done = trace.named(Span.AWAIT_KV.value), trace.named(Span.WRITE.value)
            if len(awaits) >= d_ranks and len(done) >= writes:
                return trace
        assert time.monotonic() < deadline, f"trace {trace_id}: no transfer spans in {run_dir}"
        time.sleep(0.2)


def assert_kv_geometry(trace: Trace, want: dict[str, Any], what: str) -> None:
    """Every ``prepare_descriptors`` and ``write`` span of ``trace`` carries ``want`` (keys
    of ``Attr.KV_*``), a block size, and each WRITE moved whole tokens of
    ``pushkv.kv.bytes_per_token``."""
    spans = trace.named(Span.PREPARE_DESCRIPTORS.value) + trace.named(Span.WRITE.value)
    assert spans, f"{what}: no prepare_descriptors or write span"
    for span in spans:
        got = {k: span.attributes.get(k) for k in want}
        assert got == want, (what, span.name, got)
        assert int(span.attributes[Attr.KV_BLOCK_TOKENS.value]) > 0, (what, span.name)
    per_token = int(want[Attr.KV_BYTES_PER_TOKEN.value])
    for write in trace.named(Span.WRITE.value):
        assert int(write.attributes[Attr.BYTES.value]) % per_token == 0, what


def done_transfers(url: str, side: str) -> float:
    """Transfers done so far on this server, over its ranks (each rank counts its own)."""
    with httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S, trust_env=False) as c:
        text = c.get("/metrics").text
    return metric_sum(text, Metric.TRANSFERS.value, side=side, outcome="done") or 0.0


def wait_for_transfers(
    p_url: str, d_url: str, since: tuple[float, float], want: tuple[int, int]
) -> None:
    """Until P has sent and D received ``want`` transfers more than ``since`` (each as
    ``(P send, D recv)``); the counters trail the answers by a step (bounded)."""
    deadline = time.monotonic() + METRIC_SETTLE_S
    while True:
        got = (done_transfers(p_url, "send") - since[0], done_transfers(d_url, "recv") - since[1])
        if got == want:
            return
        assert time.monotonic() < deadline, (
            f"transfers done (P sent, D received): {got}, want {want}"
        )
        time.sleep(0.2)
