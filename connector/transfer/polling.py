"""How long the transfer thread sleeps between polls (pure: the clock is an argument).

With NIXL's progress thread off, UCX progresses only inside our calls, and every wake-up
costs CPU whatever the primitive, plus the GIL taken from the engine's thread on the same
core (D's decode steps, P's prefills). So the thread polls only as often as some work
needs (``python -m bench.poll_cost`` measures what the polls cost):

- ``local``: our own work needs UCX progress (a WRITE in flight, a dial): poll from
  ``hot_min_s`` after anything happened, doubling to ``hot_max_s``. A WRITE in flight
  backs off like any other wait: its DONE only frees P's blocks, and hot polls for all of
  a WRITE take the CPU and the GIL from P's forward pass on its core.
- ``incoming``: a peer's WRITE into us is in flight (it rang WRITE, its completion has not
  come). Over TCP the WRITE completes only after our UCX progress has taken the bytes in
  and acknowledged them, so a slow poll here slows the WRITE itself. It is polled every
  ``incoming_s``, steadily (hot polls would cost several wake-ups per WRITE): the writer
  rings again when its WRITE is DONE and the completion sent, and that ring brings us to
  it at once.
- ``remote``: we only wait on a peer. With no doorbell (``fallback_s`` None) that is
  polled like local work; with one the thread sleeps ``fallback_s`` (the peer rings when
  it sends), or ``trusted_s`` when every peer waited on has rung us before (``trusted``):
  their news rings too, so the poll only covers a lost datagram. After a ring (``rung``)
  that brought nothing it polls fast for ``bell_hot_s``: a bell may beat its notification.
- Neither: ``idle_s``.
"""

from __future__ import annotations

from dataclasses import dataclass

from connector.config import PushkvConfig


@dataclass(kw_only=True)
class Backoff:
    """Built by ``from_config`` (the knobs' defaults live in ``PushkvConfig``) or, in
    tests, by hand. A new one per thread: it holds state."""

    hot_min_s: float
    hot_max_s: float
    idle_s: float
    fallback_s: float | None  # None: no doorbell
    incoming_s: float
    trusted_s: float
    bell_hot_s: float = 0.001
    delay_s: float = 0.0
    hot_until_s: float = 0.0

    @classmethod
    def from_config(cls, cfg: PushkvConfig, *, doorbell: bool) -> Backoff:
        """A transfer thread's polling policy under ``cfg``."""
        return cls(
            hot_min_s=20e-6,
            hot_max_s=cfg.poll_hot_max_s,
            idle_s=cfg.idle_poll_s(doorbell),
            fallback_s=cfg.poll_bell_fallback_s if doorbell else None,
            incoming_s=cfg.poll_incoming_s,
            trusted_s=cfg.poll_bell_trusted_s,
        )

    def next(
        self,
        now_s: float,
        *,
        active: bool,
        woken: bool,
        rung: bool,
        local: bool,
        remote: bool,
        incoming: bool = False,
        trusted: bool = False,
    ) -> float:
        """The sleep before the next poll. ``active``: the last poll handled something;
        ``woken``: the last sleep ended early (engine event or ring); ``rung``: a peer's
        "look now" ring woke it (WRITE announcements are ``incoming``, not rings)."""
        if rung and not active:  # the bell beat its news: look again soon
            self.hot_until_s = now_s + self.bell_hot_s
        if local or now_s < self.hot_until_s or (remote and self.fallback_s is None):
            self.delay_s = (
                self.hot_min_s
                if active or woken
                else min(max(self.delay_s, self.hot_min_s) * 2, self.hot_max_s)
            )
        elif incoming:
            self.delay_s = self.incoming_s
        elif remote:
            assert self.fallback_s is not None
            self.delay_s = self.trusted_s if trusted else self.fallback_s
        else:
            self.delay_s = self.idle_s
        return self.delay_s
