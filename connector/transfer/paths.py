"""What the Sender asks of a path driver: which way each target's bytes go, and the writes
that do not go through the transport's descriptors.

Owns: ``Paths`` (take a D's IPC offer, choose a path per target with
``connector.core.xfer_path``, start a non-direct write) and ``PathWrite`` (one started write,
pumped by the Sender until its completion went out). Without a driver (CPU, or
``xfer_paths: direct``) every transfer is direct. The GPU driver is
``connector.transfer.gpu.paths.GpuPaths``, built by the worker only where a GPU exists, so
this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from connector.core import messages as m
from connector.core.events import BlockTable
from connector.core.heads import HeadRange
from connector.core.xfer_path import PathChoice, XferPath


class PathWrite(Protocol):
    """One target's bytes on a path other than direct."""

    path: XferPath
    peer: str

    def pump(self) -> bool:
        """True once the bytes are in place and the completion notification went out;
        raises TransportError if that notification cannot be sent."""
        ...

    def stage_ms(self) -> dict[str, float]:
        """Device time of each stage (for the ``write`` span); call once pump is True."""
        ...

    def withhold(self) -> None:
        """The transfer was aborted: send no completion. A copy already on the device cannot
        be recalled, so pump still says when it has finished (the blocks stay held until)."""
        ...


class Paths(Protocol):
    def offered(self, agent: str, offer: m.IpcOffer) -> None:
        """D ``agent`` offers its KV for mapping; take it if this process can."""
        ...

    def forget(self, agent: str) -> None:
        """``agent`` is gone: drop its mapping."""
        ...

    def poll(self, now_ns: int) -> None:
        """Housekeeping on the transfer thread's clock (drop mappings of dead peers)."""
        ...

    def due_ns(self) -> int | None:
        """When ``poll`` next has housekeeping to do (None: nothing until something
        changes); an idle transfer thread sleeps no longer than that."""
        ...

    def choose(self, reg: m.Register, src_blocks: BlockTable, heads: HeadRange) -> PathChoice:
        """The path for one target (``heads``: the global KV heads this P rank writes to it),
        decided without planning descriptors (costly for long prompts, docs/benchmarks.md):
        the Sender plans only direct ones."""
        ...

    def bind_waker(self, wake: Callable[[], None]) -> None:
        """How to wake the transfer thread when a write's device work has finished."""
        ...

    def start(
        self,
        choice: PathChoice,
        reg: m.Register,
        src_blocks: BlockTable,
        heads: HeadRange,
        notif: bytes,
    ) -> PathWrite:
        """Begin a non-direct write (never blocks); ``notif`` goes to D when it is done."""
        ...
