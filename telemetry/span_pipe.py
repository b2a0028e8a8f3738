"""Spans out of the process: recorded where they end, encoded and written by a sink process.

Owns: ``PipeSpanProcessor``, the JSON-lines sink's span processor. ``on_end`` turns a finished
span into a ``SpanRecords`` row (plain tuples) and queues it; a thread sends the queue every
``delay_s`` as one ``marshal`` frame down a pipe to ``python -m telemetry.sink`` (one per
process), which encodes the OTLP/JSON line and writes the file. So the engine's process never
holds its GIL to encode JSON (a ``BatchSpanProcessor`` export of a batch did, for as long as
the encode took: up to the engine's 5 ms switch interval, ``python -m bench.tracing_cost``
prints the longest hold), and the file's I/O is not on its cores. ``force_flush`` returns
once the sink has written everything sent; if the sink is gone, batches are encoded and
written here instead, so no span is lost.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import marshal
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

from telemetry.exporters import _KIND, Row, SpanRecords, encode_records
from telemetry.sink import ACK, BATCH, FLUSH, FRAME

logger = logging.getLogger(__name__)


class PipeSpanProcessor(SpanProcessor):
    def __init__(self, path: str | os.PathLike[str], delay_s: float = 0.1) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._records = SpanRecords()
        self._queue: collections.deque[Row] = collections.deque()
        self._sent_headers = 0  # headers are numbered 0, 1, ...: those below went out
        self._io = threading.Lock()  # one frame at a time, and the fallback file
        self._flush_lock = threading.Lock()
        self._fallback: Any = None  # the file, written here once the sink is gone
        self._proc: subprocess.Popen[bytes] | None = None
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "telemetry.sink", str(self.path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
            )
        except OSError:
            logger.exception("Starting the span sink failed; encoding spans in-process")
        self._acks_due = 0  # flush requests the sink has not answered yet
        # A forked child (vLLM's multiproc workers) must not hold the sink's pipe open: the
        # sink exits, and shutdown's wait returns, only when every writer has closed it.
        me = weakref.ref(self)

        def after_fork() -> None:
            if (p := me()) is not None:
                p._forget()

        os.register_at_fork(after_in_child=after_fork)
        self._delay = delay_s
        # Set by the first span queued after a send: the thread blocks on it with no timeout,
        # so an idle process pays no wake-ups (python -m bench.idle_cost).
        self._wake = threading.Event()
        self._halt = threading.Event()  # cuts the batching window short at shutdown
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="pushkv-span-pipe", daemon=True)
        self._thread.start()

    def _forget(self) -> None:
        """In a forked child: this copy records nothing (the child makes a provider of its
        own, ``telemetry.setup.process_tracer``) and closes its copy of the pipe."""
        self._stopped = True
        if self._proc is not None:
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
            self._proc = None

    # -- the recording path: any thread that ends a span -----------------------------------
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if not span.context.trace_flags.sampled or self._stopped:
            return
        self._queue.append(self._records.record(span))
        if not self._wake.is_set():
            self._wake.set()

    def emitter(self, tracer: Any, processors: Any) -> Callable[..., Any]:
        """``telemetry.emit.emit``'s direct path for ``tracer``: a finished span with explicit
        times straight to a record, without the SDK's span object (its attribute checks,
        locks and copies were most of a span's cost, ``python -m bench.tracing_cost``).
        The same ids, sampling and fields as ``tracer.start_span(...)`` then ``end``;
        None (use the SDK) while this is not the provider's only span processor
        (``processors``: the provider's multi-processor), or the tracer is disabled."""
        gid = self._records.group(tracer.resource, tracer._instrumentation_scope)
        sampler, ids, queue, wake = tracer.sampler, tracer.id_generator, self._queue, self._wake

        def emit(
            name: str,
            parent: Any,
            kind: SpanKind,
            start: int,
            end: int,
            attrs: dict[str, Any],
            events: Any,
            error: str | None,
        ) -> Any:
            if processors._span_processors != (self,) or not tracer._is_enabled():
                return None
            found = trace_api.get_current_span(parent).get_span_context()
            parent_sc = found if found.is_valid else None
            trace_id = ids.generate_trace_id() if parent_sc is None else parent_sc.trace_id
            sampled = sampler.should_sample(parent, trace_id, name, kind, attrs, ())
            flags = TraceFlags(TraceFlags.SAMPLED if sampled.decision.is_sampled() else 0)
            ctx = SpanContext(
                trace_id,
                ids.generate_span_id(),
                is_remote=False,
                trace_flags=flags,
                trace_state=sampled.trace_state,
            )
            if sampled.decision.is_sampled() and not self._stopped:
                ts = sampled.trace_state
                queue.append(
                    (
                        gid,
                        (
                            trace_id,
                            ctx.span_id,
                            tuple(ts.items()) if ts else None,
                            None if parent_sc is None else parent_sc.span_id,
                            parent_sc is not None and parent_sc.is_remote,
                            name,
                            _KIND[kind],
                            start,
                            end,
                            dict(sampled.attributes) if sampled.attributes else None,
                            0,
                            tuple((ev, at, None, 0) for ev, at in events) or None,
                            0,
                            None,
                            0,
                            2 if error is not None else 0,  # StatusCode.ERROR, UNSET
                            error,
                        ),
                    )
                )
                if not wake.is_set():
                    wake.set()
            return trace_api.NonRecordingSpan(ctx)

        return emit

    # -- the sending thread ----------------------------------------------------------------
    def _run(self) -> None:
        # A span queued after the clear sets the event again; one queued before it is in the
        # queue this send drains: none waits for a later span to be sent.
        while not self._stopped:
            self._wake.wait()
            self._halt.wait(self._delay)  # gather the batch
            self._wake.clear()
            self._send()

    def _send(self) -> None:
        """Whatever is queued, in one frame. Rows are taken before headers: a row's header
        was made before the row was queued, so it is in this frame or an earlier one."""
        with self._io:
            q = self._queue
            rows = [q.popleft() for _ in range(len(q))]
            headers = self._records.headers
            n = len(headers)
            new = {g: headers[g] for g in range(self._sent_headers, n)}
            if not rows and not new:
                return
            self._sent_headers = n
            if self._proc is not None and self._fallback is None:
                payload = marshal.dumps((new, rows))
                if self._write(FRAME.pack(BATCH, len(payload)) + payload):
                    return
            self._write_here(rows)

    def _write(self, frame: bytes) -> bool:
        assert self._proc is not None and self._proc.stdin is not None
        try:
            fd, view = self._proc.stdin.fileno(), memoryview(frame)
            while view:  # os.write releases the GIL while the pipe is full
                view = view[os.write(fd, view) :]
            return True
        except (OSError, ValueError):
            logger.warning("The span sink of %s is gone; writing spans in-process", self.path)
            self._fallback = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            return False

    def _write_here(self, rows: list[Row]) -> None:
        if self._fallback is None:
            self._fallback = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        if rows and not self._fallback.closed:
            self._fallback.write(encode_records(self._records.headers, rows))
            self._fallback.flush()

    # -- flush and shutdown ----------------------------------------------------------------
    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Send what is queued and wait until the sink has written it (at most the timeout)."""
        deadline = time.monotonic() + timeout_millis / 1e3
        with self._flush_lock:
            self._send()
            with self._io:
                proc = self._proc
                if self._fallback is not None or proc is None or proc.stdout is None:
                    return True
                if not self._write(FRAME.pack(FLUSH, 0)):
                    return True
                self._acks_due += 1
            fd = proc.stdout.fileno()
            # Answers come in order: ours is the last one due (an earlier flush that timed
            # out left its own unread).
            while (left := deadline - time.monotonic()) > 0:
                if not select.select([fd], [], [], left)[0]:
                    break
                got = os.read(fd, self._acks_due)
                if not got:
                    return False  # the sink is gone: the next send falls back
                self._acks_due -= got.count(ACK)
                if self._acks_due == 0:
                    return True
            return False

    def shutdown(self) -> None:
        """Flush, then end the sink (end of input) and wait for it to finish writing."""
        if self._stopped:
            return
        self.force_flush(5_000)
        self._stopped = True
        self._halt.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._send()
        with self._io:
            if self._proc is not None:
                for pipe in (self._proc.stdin, self._proc.stdout):
                    if pipe is not None:
                        pipe.close()
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    logger.warning("The span sink of %s is still writing", self.path)
            if self._fallback is not None:
                self._fallback.close()
