"""telemetry/batching.py: spans go out within the delay, at once when a batch is full, all of
them on flush and shutdown; the export thread starts with the first span and does not wake
while nothing is queued."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

from telemetry.batching import QuietBatchSpanProcessor

WAIT_S = 5.0  # bound on every wait below; the happy path takes milliseconds


class Recorder:
    """An exporter that records batches and signals each one."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.exported = threading.Semaphore(0)
        self.shut = False

    def export(self, spans: Sequence[Any]) -> None:
        self.batches.append([s.name for s in spans])
        self.exported.release()

    def shutdown(self) -> None:
        self.shut = True

    @property
    def names(self) -> list[str]:
        return [n for b in self.batches for n in b]


def _provider(delay_s: float, batch: int = 512) -> tuple[TracerProvider, Recorder, Any]:
    rec = Recorder()
    proc = QuietBatchSpanProcessor(rec, schedule_delay_s=delay_s, max_export_batch_size=batch)
    provider = TracerProvider()
    provider.add_span_processor(proc)
    return provider, rec, proc


def test_a_span_is_exported_within_the_delay() -> None:
    provider, rec, _ = _provider(0.05)
    t0 = time.monotonic()
    provider.get_tracer("t").start_span("a").end()
    assert rec.exported.acquire(timeout=WAIT_S)
    assert rec.names == ["a"] and time.monotonic() - t0 < WAIT_S
    provider.shutdown()
    assert rec.shut


def test_a_full_batch_goes_at_once_without_waiting_for_the_delay() -> None:
    provider, rec, _ = _provider(3600.0, batch=3)  # the delay alone would never export
    tracer = provider.get_tracer("t")
    for name in "abc":
        tracer.start_span(name).end()
    assert rec.exported.acquire(timeout=WAIT_S), "a full batch must not wait for the delay"
    assert rec.batches == [["a", "b", "c"]]
    provider.shutdown()


def test_flush_and_shutdown_export_everything_queued() -> None:
    provider, rec, _ = _provider(3600.0)
    tracer = provider.get_tracer("t")
    tracer.start_span("a").end()
    assert provider.force_flush()
    assert rec.names == ["a"]
    tracer.start_span("b").end()
    provider.shutdown()
    assert rec.names == ["a", "b"] and rec.shut
    tracer.start_span("c").end()  # after shutdown: refused, not queued
    assert rec.names == ["a", "b"]


def test_unsampled_spans_are_not_exported() -> None:
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    rec = Recorder()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(QuietBatchSpanProcessor(rec, schedule_delay_s=0.01))
    provider.get_tracer("t").start_span("a").end()
    provider.shutdown()
    assert rec.names == []


def test_no_thread_before_the_first_span_and_none_awake_while_idle() -> None:
    provider, rec, proc = _provider(0.01)
    assert proc._thread is None, "no export thread until a span ends"
    provider.get_tracer("t").start_span("a").end()
    assert rec.exported.acquire(timeout=WAIT_S)
    thread = proc._thread
    assert thread is not None and thread.is_alive()
    # Idle: the thread waits on the condition with no timeout. Count its wake-ups over
    # many schedule delays through the condition's wait (a timed wait would return).
    waits: list[float | None] = []
    real_wait = proc._cond.wait

    def counting_wait(timeout: float | None = None) -> bool:
        waits.append(timeout)
        return real_wait(timeout)

    proc._cond.wait = counting_wait  # type: ignore[method-assign]
    provider.get_tracer("t").start_span("b").end()  # one more cycle, through counting_wait
    assert rec.exported.acquire(timeout=WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while (not waits or waits[-1] is not None) and time.monotonic() < deadline:
        time.sleep(0.001)  # polling a condition with a bound, not synchronising on time
    assert waits and waits[-1] is None, f"the idle wait must have no timeout: {waits}"
    n = len(waits)
    time.sleep(0.1)  # ten schedule delays with nothing queued
    assert len(waits) == n, "an idle export thread must not wake"
    provider.shutdown()
    assert not thread.is_alive()


def test_queue_full_drops_and_counts() -> None:
    rec = Recorder()
    proc = QuietBatchSpanProcessor(
        rec, schedule_delay_s=3600.0, max_export_batch_size=100, max_queue_size=2
    )
    provider = TracerProvider()
    provider.add_span_processor(proc)
    for name in "abc":
        provider.get_tracer("t").start_span(name).end()
    assert proc.dropped == 1
    provider.shutdown()
    assert rec.names == ["a", "b"]
