"""Tracer set-up for one process, from the standard OpenTelemetry environment variables.

Owns: choosing the sink and building the ``TracerProvider``. Entry points call
``setup_tracing`` once; library code only takes a ``tracer_provider`` (default: the global
one) and imports the OpenTelemetry API, never this module's SDK objects.

Sinks: ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set -> OTLP
(``OTEL_EXPORTER_OTLP_PROTOCOL`` ``grpc`` or ``http/protobuf``, the default); otherwise OTLP JSON
lines in ``<run dir>/traces-<service>-<pid>.jsonl`` (run dir: the ``run_dir`` argument, else
``PUSHKV_RUN_DIR``, else ``runs/latest``), encoded and written by a sink process of each
process's own (``telemetry.span_pipe``). ``OTEL_SDK_DISABLED=true`` turns tracing off.
Sampling is the SDK's (``OTEL_TRACES_SAMPLER``, default parent-based always-on), so P and D
follow the router's decision and a trace is never half-sampled. Spans are flushed at exit.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Any

from telemetry.schema import Resource as R

_PROCESS: dict[int, Any] = {}  # pid -> provider (or None: tracing off); forks start afresh


def _id_generator() -> Any:
    """Span and trace ids from a generator of our own, seeded from the OS: vLLM seeds the
    ``random`` module with the model seed in every engine process, so the SDK's default
    generator gave P and D the same span ids (P's ``prefill`` and D's ``register`` could
    share one). Not ``os.urandom`` per id: a syscall per id would be most of a span's cost
    (``python -m bench.tracing_cost``). Reseeded in a forked child, which must not repeat
    its parent's ids."""
    import random

    from opentelemetry.sdk.trace.id_generator import IdGenerator

    class SeededFromOs(IdGenerator):
        def __init__(self) -> None:
            self._rng = random.Random(os.urandom(32))
            os.register_at_fork(after_in_child=self._reseed)

        def _reseed(self) -> None:
            self._rng.seed(os.urandom(32))

        def generate_span_id(self) -> int:
            return self._rng.getrandbits(64) or 1

        def generate_trace_id(self) -> int:
            return self._rng.getrandbits(128) or 1

    return SeededFromOs()


def _provider_class() -> Any:
    """The SDK's provider, whose tracers carry ``pushkv_emit`` (``telemetry.emit``'s direct
    path) where spans go to a ``PipeSpanProcessor``."""
    from opentelemetry.sdk.trace import TracerProvider

    from telemetry.span_pipe import PipeSpanProcessor

    class Provider(TracerProvider):
        def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
            tracer = super().get_tracer(*args, **kwargs)
            procs = self._active_span_processor
            for proc in procs._span_processors:
                if isinstance(proc, PipeSpanProcessor) and hasattr(tracer, "sampler"):
                    tracer.pushkv_emit = proc.emitter(tracer, procs)  # type: ignore[attr-defined]
            return tracer

    return Provider


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def setup_tracing(
    service_name: str,
    *,
    role: str,
    run_dir: str | os.PathLike[str] | None = None,
    attributes: dict[str, Any] | None = None,
    set_global: bool = True,
    export_delay_ms: int = 500,
) -> Any:
    """Build (and by default install) this process's TracerProvider; None when disabled."""
    if _env("OTEL_SDK_DISABLED").lower() == "true":
        return None
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource

    name = _env("OTEL_SERVICE_NAME") or service_name
    resource = Resource.create(
        {R.SERVICE_NAME.value: name, R.ROLE.value: role, **(attributes or {})}
    )
    provider = _provider_class()(resource=resource, id_generator=_id_generator())
    provider.add_span_processor(_processor(name, run_dir, export_delay_ms))
    if set_global:
        trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)  # flushes: spans are not lost when the process exits
    return provider


def _processor(service: str, run_dir: str | os.PathLike[str] | None, delay_ms: int) -> Any:
    """OTLP: the SDK's batch processor and exporter. JSON lines: spans recorded here and
    encoded and written by a sink process of their own (``telemetry.span_pipe``), or, with
    ``PUSHKV_SPAN_SINK=thread``, by the batch processor's thread in this process. Not the
    SDK's ``BatchSpanProcessor``: its thread wakes every delay even with nothing queued."""
    from telemetry.batching import QuietBatchSpanProcessor

    endpoint = _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or _env("OTEL_EXPORTER_OTLP_ENDPOINT")
    if endpoint:
        return QuietBatchSpanProcessor(
            _otlp_exporter(),
            max_queue_size=65536,
            max_export_batch_size=2048,
            schedule_delay_s=delay_ms / 1e3,
        )
    folder = Path(run_dir or _env("PUSHKV_RUN_DIR") or "runs/latest")
    path = folder / f"traces-{service}-{os.getpid()}.jsonl"
    if _env("PUSHKV_SPAN_SINK") == "thread":
        from telemetry.exporters import JsonLinesSpanExporter

        return QuietBatchSpanProcessor(
            JsonLinesSpanExporter(path),
            max_queue_size=65536,
            max_export_batch_size=2048,
            schedule_delay_s=delay_ms / 1e3,
        )
    from telemetry.span_pipe import PipeSpanProcessor

    return PipeSpanProcessor(path, delay_s=delay_ms / 1e3)


def _otlp_exporter() -> Any:
    proto = (
        _env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or _env("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()  # reads the endpoint and headers from the environment
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http()


def process_tracer(
    service_name: str, *, role: str, attributes: dict[str, Any] | None = None, scope: str = "pushkv"
) -> Any:
    """The tracer of this process's own provider, made on first use (None when tracing is
    off). For code that lives inside another program (vLLM's EngineCore and workers): the
    provider is not installed globally, so vLLM's own tracing set-up is left alone, and the
    scheduler and a worker sharing one process share one provider and one file."""
    pid = os.getpid()
    if pid not in _PROCESS:
        # Export within 100 ms: a vLLM process can be killed at shutdown with spans still
        # queued, and an idle export thread costs nothing.
        _PROCESS[pid] = setup_tracing(
            service_name, role=role, attributes=attributes, set_global=False, export_delay_ms=100
        )
    provider = _PROCESS[pid]
    return None if provider is None else provider.get_tracer(scope)


def flush_process(timeout_ms: int = 5000) -> None:
    """Write out every span of this process's provider (``process_tracer``) now. For
    shutdown paths that end with a signal or SIGKILL, where atexit handlers never run."""
    provider = _PROCESS.get(os.getpid())
    if provider is not None:
        provider.force_flush(timeout_ms)
