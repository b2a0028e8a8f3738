"""Test-only fault injection on a real engine: ``FaultyTransport`` wraps a rank's transport.

Owns: failing a WRITE's post (P), holding a WRITE in flight until D's cancel for it has
arrived (P), and losing a transfer's first ``done`` notification (D), for transfers whose
prompt has a chosen number of tokens (the registration says it), so a test picks the
faulty request by its prompt; on D it also feeds and polls the freed-block check
(``pushkv_testing.freed_check``). Configured by ``kv_connector_extra_config``'s
``_faults`` (``connector.config.Faults``, docs/operations.md#fault-injection-test-only);
absent by default, when nothing is wrapped and nothing costs. Never for production, and
not in the wheel: ``connector.worker_side`` imports this module only when ``_faults`` is set
(``wrap_transport``), which needs this folder on the engine's ``PYTHONPATH``.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from connector.config import Faults, PushkvConfig
from connector.core import messages as m
from connector.core.digest_ranges import dest_runs
from connector.core.errors import RemoteProtocolError, TransportError
from connector.engine_spans import engine_tracer
from connector.transport.base import WriteHandle, validate_write_descs
from pushkv_testing.freed_check import FreedCheck
from telemetry.counts import Counts
from telemetry.schema import Count

logger = logging.getLogger(__name__)

# What P logs when it posts a held WRITE (tests look for it with the transfer id).
POSTED_AFTER_CANCEL = "held WRITE posted after D's cancel"
POSTED_UNCANCELLED = "held WRITE posted with no cancel"


@dataclass
class _Held:
    """A WRITE the Sender issued that is not posted yet (``hold_write_tokens``)."""

    tid: str
    args: tuple[Any, ...]
    mem: dict[str, str]
    post_by_s: float
    inner: WriteHandle | None = None


def _decode(frame: bytes) -> m.Message | None:
    if not m.is_frame(frame):
        return None
    try:
        return m.decode(frame)
    except RemoteProtocolError:
        return None  # the transfer thread drops and counts it


class FaultyTransport:
    """Every Transport member passes through to ``inner``; ``write``, ``poll_write``,
    ``release``, ``send_notif`` and ``get_notifs`` first apply ``faults``."""

    def __init__(
        self,
        inner: Any,
        faults: Faults,
        freed: FreedCheck | None = None,
        clock: Callable[[], float] = time.monotonic,
        layout: Any = None,
    ) -> None:
        self._inner, self._faults, self.freed, self._clock = inner, faults, freed, clock
        self._layout = layout  # D's KVLayout (flip_kv_tokens)
        self._flip: dict[str, m.Register] = {}  # D: registrations whose KV gets a byte flipped
        self._fail_write: set[str] = set()  # P: transfer ids whose WRITE post fails
        self._drop_done: set[str] = set()  # D: transfer ids whose first `done` is lost
        self._hold: set[str] = set()  # P: transfer ids whose WRITE is to be held
        self._held: dict[str, bool] = {}  # P: ... held now: has D's cancel come?
        self.counters: Counts = Counts()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _injected(self, kind: str, tid: str) -> None:
        self.counters.add(Count.INJECTED, kind)
        logger.warning("pushkv test fault injected: %s (transfer %s)", kind, tid)

    def send_notif(self, peer: str, msg: bytes) -> None:
        if (
            self._faults.drop_completion_tokens
            or self._faults.flip_kv_tokens
            or self.freed is not None
        ):
            sent = _decode(msg)
            tokens = self._faults.drop_completion_tokens
            if isinstance(sent, m.Register) and tokens and sent.num_tokens == tokens:
                self._drop_done.add(sent.transfer_id)
            flip = self._faults.flip_kv_tokens
            if isinstance(sent, m.Register) and flip and sent.num_tokens == flip:
                self._flip[sent.transfer_id] = sent
            if self.freed is not None and sent is not None:
                self.freed.sent(sent)
        self._inner.send_notif(peer, msg)

    def get_notifs(self) -> list[tuple[str, bytes]]:
        if self.freed is not None:
            self.freed.poll()
        out = []
        for agent, frame in self._inner.get_notifs():
            msg = _decode(frame)
            if isinstance(msg, m.Register) and msg.num_tokens == self._faults.fail_write_tokens:
                self._fail_write.add(msg.transfer_id)
            if isinstance(msg, m.Register) and msg.num_tokens == self._faults.hold_write_tokens:
                self._hold.add(msg.transfer_id)
            if isinstance(msg, m.Cancel) and msg.transfer_id in self._held:
                self._held[msg.transfer_id] = True
            if isinstance(msg, m.Completion) and msg.transfer_id in self._flip:
                self._flip_byte(self._flip.pop(msg.transfer_id), msg)
            if isinstance(msg, m.Completion) and msg.transfer_id in self._drop_done:
                self._drop_done.discard(msg.transfer_id)  # only the first: a resend gets in
                self._injected("drop_completion", msg.transfer_id)
                continue
            out.append((agent, frame))
        return out

    def _flip_byte(self, reg: m.Register, done: m.Completion) -> None:
        """Corrupt the first byte this P rank wrote into our blocks (its bytes have landed:
        the WRITE's `done` comes after them)."""
        lay = self._layout
        if lay is None or lay.mem_type != "DRAM":
            return
        heads = done.digest.heads if done.digest is not None else lay.heads
        addr, _ = dest_runs(
            lay, reg.block_ids, first_token=reg.first_token, num_tokens=reg.num_tokens, heads=heads
        )
        if addr.size:
            byte = (ctypes.c_ubyte * 1).from_address(int(addr[0]))
            byte[0] ^= 0xFF
            self._injected("flip_kv", reg.transfer_id)

    def write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, notif: bytes, **mem: str
    ) -> WriteHandle:
        done = _decode(notif)  # the WRITE's own `done` names its transfer
        if done is not None and done.transfer_id in self._fail_write:
            self._fail_write.discard(done.transfer_id)
            self._injected("fail_write", done.transfer_id)
            raise TransportError("injected WRITE failure (test-only _faults)")
        if done is not None and done.transfer_id in self._hold:
            self._hold.discard(done.transfer_id)
            self._held[done.transfer_id] = False
            self._injected("hold_write", done.transfer_id)
            src_a, _, nbytes = validate_write_descs(src, dst)
            held = _Held(
                done.transfer_id,
                (peer, src, dst, notif),
                dict(mem),
                self._clock() + self._faults.hold_write_s,
            )
            return WriteHandle(peer, nbytes, len(src_a), time.time_ns(), native=held)
        handle: WriteHandle = self._inner.write(peer, src, dst, notif, **mem)
        return handle

    def poll_write(self, handle: WriteHandle) -> bool:
        held = handle.native
        if not isinstance(held, _Held):
            done: bool = self._inner.poll_write(handle)
            return done
        if held.inner is None:
            cancelled = self._held[held.tid]
            if not cancelled and self._clock() < held.post_by_s:
                return False  # in flight, as far as the Sender knows
            del self._held[held.tid]
            # Posted only now: when D's cancel came first, every byte lands after it.
            held.inner = self._inner.write(*held.args, **held.mem)
            logger.warning(
                "pushkv test fault: %s (transfer %s)",
                POSTED_AFTER_CANCEL if cancelled else POSTED_UNCANCELLED,
                held.tid,
            )
        inner_done: bool = self._inner.poll_write(held.inner)
        return inner_done

    def release(self, handle: WriteHandle) -> None:
        held = handle.native
        if not isinstance(held, _Held):
            self._inner.release(handle)
            return
        handle.released = True
        if held.inner is not None:
            self._inner.release(held.inner)
        else:
            self._held.pop(held.tid, None)  # aborted before it was posted: never is


def wrap_transport(
    transport: Any, cfg: PushkvConfig, layout: Any, *, engine_id: str, consumer: bool
) -> tuple[FaultyTransport, FreedCheck | None]:
    """The worker's transport under ``cfg.faults``, and D's freed-block check (None unless
    ``check_freed_tokens`` is set on D; it also listens to the receiver's reports)."""
    faults = cfg.faults
    assert faults is not None
    freed = None
    if faults.check_freed_tokens and consumer:
        freed = FreedCheck(
            faults.check_freed_tokens,
            layout,
            cfg.receiver_policy(),
            tracer=engine_tracer(engine_id, producer=False),
            engine_id=engine_id,
        )
    return FaultyTransport(transport, faults, freed, layout=layout), freed
