"""A batching span processor whose export thread sleeps while there is nothing to export.

Owns: ``QuietBatchSpanProcessor``. The SDK's ``BatchSpanProcessor`` wakes its thread every
schedule delay whether or not a span is queued: in each vLLM engine process (100 ms, so
spans are out before a shutdown's kill) that was most of an idle pushkv pair's CPU over a
plain pair (``python -m bench.idle_cost``). This one keeps the SDK's promise (a span is
exported at most ``schedule_delay_s`` after it ended, at once when a batch is full, all of
them on ``force_flush`` and ``shutdown``) but its thread blocks with no timeout while the
queue is empty, and is started only by the first span of its process (a forked child
starts afresh, as the SDK's does).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from typing import Any

from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, attach, detach, set_value
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

logger = logging.getLogger(__name__)


class QuietBatchSpanProcessor(SpanProcessor):
    def __init__(
        self,
        exporter: Any,
        *,
        schedule_delay_s: float,
        max_export_batch_size: int = 512,
        max_queue_size: int = 2048,
    ) -> None:
        self._exporter = exporter
        self._delay_s, self._batch, self._max_queue = (
            schedule_delay_s,
            max_export_batch_size,
            max_queue_size,
        )
        self._init_state()
        self.dropped = 0  # spans refused because the queue was full
        reinit = weakref.WeakMethod(self._init_state)

        def after_fork() -> None:  # the parent's thread and spans do not exist in a child
            if (method := reinit()) is not None:
                method()

        os.register_at_fork(after_in_child=after_fork)

    def _init_state(self) -> None:
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._cond = threading.Condition()
        self._export_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._shutdown = False

    # ------------------------------------------------------------ SpanProcessor
    def on_start(self, span: Span, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if self._shutdown or span.context is None or not span.context.trace_flags.sampled:
            return
        with self._cond:
            if len(self._queue) >= self._max_queue:
                self.dropped += 1
                if self.dropped & (self.dropped - 1) == 0:  # 1st, 2nd, 4th...: a flood stays quiet
                    logger.warning("Span queue full: %d spans dropped so far", self.dropped)
                return
            self._queue.append(span)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name="OtelQuietBatchSpanProcessor", daemon=True
                )
                self._thread.start()
            n = len(self._queue)
            if n == 1 or n >= self._batch:  # the first span starts the clock; a full batch goes now
                self._cond.notify()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._export_all()
        return True

    def shutdown(self) -> None:
        if self._shutdown:
            return
        with self._cond:
            self._shutdown = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(30.0)
        self._export_all()
        self._exporter.shutdown()

    # ------------------------------------------------------------ the export thread
    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._shutdown:
                    self._cond.wait()  # nothing queued: no timer, no wake-ups
                if self._shutdown:
                    return  # shutdown() exports what is left
                due = time.monotonic() + self._delay_s
                while len(self._queue) < self._batch and not self._shutdown:
                    left = due - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            self._export_all()

    def _export_all(self) -> None:
        with self._export_lock:
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]
                # The exporter's own I/O must not be traced (the SDK's processor does the same).
                token = attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))
                try:
                    self._exporter.export(batch)
                except Exception:  # a failed export loses that batch, never the thread
                    logger.exception("Exporting %d spans failed", len(batch))
                finally:
                    detach(token)
