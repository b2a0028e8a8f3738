"""Where device work runs and how the host learns it finished: ``Lane`` and ``Mark``.

Owns: a CUDA stream with its events, or on CPU a stand-in that runs work at once and
whose marks are always done, so the staged path's driver (``staged.py``) is the same
code on both and CI runs it on CPU tensors. Imports torch; touches CUDA only for a CUDA
device.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch


class Mark:
    """A point in a lane's work: ``done()`` once everything enqueued before it ran."""

    def __init__(self, event: Any | None) -> None:
        self.event = event
        self.host_ns = time.monotonic_ns()  # CPU lanes: when the work before it finished

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def elapsed_ms(self, later: Mark) -> float:
        """Device time from this mark to ``later`` (both done)."""
        if self.event is None or later.event is None:
            return (later.host_ns - self.host_ns) / 1e6
        return float(self.event.elapsed_time(later.event))


class Lane:
    """One CUDA stream of ``device`` (a new one unless ``stream`` is given), or the host."""

    def __init__(self, device: torch.device | str, stream: Any | None = None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = (stream or torch.cuda.Stream(self.device)) if self.cuda else None

    @contextmanager
    def active(self) -> Iterator[None]:
        """Work issued inside runs on this lane."""
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            yield

    def record(self) -> Mark:
        if not self.cuda:
            return Mark(None)
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return Mark(event)

    def wait_for(self, other: Mark | Any | None) -> None:
        """Later work on this lane starts after ``other`` (a Mark or a torch CUDA event, e.g.
        the forward's): how P's gather never reads KV its step has not written yet."""
        event = other.event if isinstance(other, Mark) else other
        if self.cuda and event is not None:
            self.stream.wait_event(event)  # type: ignore[union-attr]

    def synchronize(self) -> None:
        if self.cuda:
            self.stream.synchronize()  # type: ignore[union-attr]
