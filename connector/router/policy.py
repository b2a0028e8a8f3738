"""Backend choice and health bookkeeping: pure, no I/O, no clocks, no asyncio.

Owns: ``Health`` (one state per backend, never membership in several sets), ``BackendLoad``
(the numbers the policy reads), ``choose`` (least outstanding among eligible backends) and
``unavailable_reason``. The I/O side (``backends.py``) feeds it health results and leg
outcomes; the request path asks it whom to use.

Must not import: httpx, starlette, asyncio, or anything else of the router.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DOWN_AFTER = 3


@dataclass(frozen=True)
class Signals:
    """One scrape of an engine's /metrics: its queue and KV usage, and when (``at``, the
    scraper's monotonic seconds) they were read. Stale ones are ignored (``chooser.py``)."""

    waiting: float  # vllm:num_requests_waiting
    running: float  # vllm:num_requests_running
    kv_usage: float  # vllm:kv_cache_usage_perc, a fraction 0..1
    at: float


class Health(enum.Enum):
    UNKNOWN = "unknown"  # not checked yet: not used
    HEALTHY = "healthy"  # last /health answered 200
    SUSPECT = "suspect"  # healthy, but a leg failed since: used only if no healthy one is left
    DOWN = "down"  # last /health failed


@dataclass
class BackendLoad:
    """The policy's view of one backend. Mutated only through its methods."""

    index: int
    health: Health = Health.UNKNOWN
    key: str = ""  # the backend's URL: names it to the prefix policy's rendezvous
    # False while a push-mode P's transfer coordinates are unknown (not probed yet).
    ready: bool = True
    outstanding: int = 0  # legs sent and not finished
    dispatched: int = 0  # legs ever sent
    failed: int = 0  # legs that ended in an error (any kind)
    missed: int = 0  # health checks failed in a row
    # Taken out of rotation by the operator (``POST /admin/backends/.../drain``): no new
    # legs, its legs in flight run on; health is still checked. Orthogonal to ``health``.
    draining: bool = False
    # The engine's own view (its /metrics, ``signals.py``); None until first scraped.
    signals: Signals | None = None

    @property
    def eligible(self) -> bool:
        return self.health is Health.HEALTHY and self.ready and not self.draining

    @property
    def fallback(self) -> bool:
        """Usable when no backend of its role is eligible: a leg failed since its last good
        check, which a dead server and one dropped connection both cause."""
        return self.health is Health.SUSPECT and self.ready and not self.draining

    def record_health(self, ok: bool, *, answered: bool = True) -> bool:
        """Apply one health-check result. True when the backend just became healthy
        (from unknown, down or suspect): the caller re-learns what a restart may change."""
        came_back = ok and self.health is not Health.HEALTHY
        self.missed = 0 if ok else self.missed + 1
        # A check that timed out (``answered=False``) on a loaded host must not take the
        # only D out of service: a healthy backend goes down after DOWN_AFTER timeouts in a
        # row. A refused connection or a non-200 answer takes it down at once.
        if ok:
            self.health = Health.HEALTHY
        elif answered or self.health is not Health.HEALTHY or self.missed >= DOWN_AFTER:
            self.health = Health.DOWN
        return came_back

    def record_leg_failure(self, *, suspect: bool) -> None:
        """A leg failed. ``suspect`` for failures of the backend (connect, timeout, 5xx,
        broken stream), not for requests it rightly refused (4xx)."""
        self.failed += 1
        if suspect and self.health is Health.HEALTHY:
            self.health = Health.SUSPECT

    def begin_leg(self) -> None:
        self.outstanding += 1
        self.dispatched += 1

    def end_leg(self) -> None:
        if self.outstanding <= 0:
            raise ValueError(f"backend {self.index}: end_leg without begin_leg")
        self.outstanding -= 1


def usable(loads: Iterable[BackendLoad]) -> list[BackendLoad]:
    """The backends a leg may go to: the eligible ones, else the suspect ones (``choose``)."""
    loads = list(loads)
    return [b for b in loads if b.eligible] or [b for b in loads if b.fallback]


def choose(loads: Iterable[BackendLoad]) -> BackendLoad | None:
    """Least outstanding legs among eligible backends. Ties go to the one that has served
    fewer legs so far (so a sequential client still spreads), then to the lower index.
    With none eligible, the same among suspect ones: one dropped connection to the only P
    turned every request into a 503 until the next health check (198 of 480 in a benchmark
    run); a dead server still goes down at that check. ``None`` when neither is left."""
    return min(usable(loads), key=lambda b: (b.outstanding, b.dispatched, b.index), default=None)


def unavailable_reason(prefill: Sequence[BackendLoad], decode: Sequence[BackendLoad]) -> str | None:
    """Why no request can be routed now, or ``None`` when ``choose`` finds a P and a D."""
    reasons = []
    for role, loads in (("prefill", prefill), ("decode", decode)):
        if not any(b.eligible or b.fallback for b in loads):
            states = ", ".join(
                f"{role}[{b.index}]={b.health.value}{'' if b.ready else ' (not probed)'}"
                f"{' (draining)' if b.draining else ''}"
                for b in loads
            )
            reasons.append(f"no healthy {role} server ({states})")
    return "; ".join(reasons) or None
