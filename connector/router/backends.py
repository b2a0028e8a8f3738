"""The P and D servers as the router sees them: one HTTP client each, health, coordinates.

Owns: ``Role``, ``Backend``, ``Lease`` (one leg's claim on a backend's outstanding count),
and ``Backends``: the per-backend client (``upstream.Upstream``, started in ``start``,
closed in ``stop``: the app's lifespan calls both), the background health loop and the probe that
teaches the router each P's transfer coordinates in push mode. Choice itself is
``policy.choose``.

Must not import: starlette, uvicorn, ``connector.router.app`` / ``relay``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from connector.core.errors import RemoteProtocolError
from connector.router import legs, signals
from connector.router.chooser import Choice, Chooser
from connector.router.config import Mode, RouterConfig
from connector.router.coords import CoordOverride, PrefillCoords
from connector.router.policy import BackendLoad, Health, choose, unavailable_reason
from connector.router.upstream import Reply, TransportError, Upstream

logger = logging.getLogger(__name__)

# A backend out of service (down, not checked yet, or a P whose probe has not answered) is
# checked again this often, not every health interval: a restarted P is probed and back in
# rotation within this (plus its probe) of its /health answering. A refused connection
# costs nothing; an in-service backend is still checked every health interval.
RECHECK_S = 0.5


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class Backend:
    role: Role
    index: int
    url: str
    load: BackendLoad
    override: CoordOverride = field(default_factory=CoordOverride)
    # P only: where D reaches this P's KV (flags, probe, or both). None: not known yet.
    coords: PrefillCoords | None = None
    client: Upstream | None = None
    removed: bool = False  # forgotten (``Backends.remove``): its client is closed
    # Set when its last leg ends; ``wait_idle``'s waiters (an admin drain, a removal) share it.
    idle: asyncio.Event | None = field(default=None, repr=False)
    # One health check (and probe) at a time: two at once (the recheck loop's and a round's
    # or ``add``'s) would both see it come back and probe it twice.
    checking: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def name(self) -> str:
        return f"{self.role.value}[{self.index}] {self.url}"

    @property
    def http(self) -> Upstream:
        if self.client is None:
            raise RuntimeError(f"{self.name}: router not started (no HTTP client)")
        return self.client

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no leg of this backend is in flight; False if ``timeout_s`` passed."""
        if self.load.outstanding == 0:
            return True
        if self.idle is None or self.idle.is_set():  # one event for all who wait at once
            self.idle = asyncio.Event()
        try:
            async with asyncio.timeout(timeout_s):
                await self.idle.wait()
        except TimeoutError:
            return self.load.outstanding == 0
        return True

    def record_leg_failure(self, *, suspect: bool) -> None:
        """Count a failed leg (``BackendLoad.record_leg_failure``); log the change to
        suspect once (the next good health check logs the way back)."""
        before = self.load.health
        self.load.record_leg_failure(suspect=suspect)
        if self.load.health is not before:
            logger.warning("router backend %s: %s -> %s", self.name, before.value, "suspect")

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": self.index,
            "url": self.url,
            "health": self.load.health.value,
            "eligible": self.load.eligible,
            "draining": self.load.draining,
            "outstanding": self.load.outstanding,
            "dispatched": self.load.dispatched,
            "failed": self.load.failed,
        }
        if (sig := self.load.signals) is not None:
            out["signals"] = {"waiting": sig.waiting, "running": sig.running, "kv": sig.kv_usage}
        if self.role is Role.PREFILL:
            out["ready"] = self.load.ready
            out["coords"] = self.coords.as_dict() if self.coords else None
        return out


class Lease:
    """One leg's claim on a backend. ``release`` is idempotent, so every exit path (normal,
    error, cancellation before the leg's task even ran) may call it."""

    def __init__(self, backend: Backend, choice: Choice | None = None) -> None:
        self.backend = backend
        self.choice = choice  # why this backend (the route span's reason); None: not a choice
        self._held = True
        backend.load.begin_leg()

    def release(self) -> None:
        if self._held:
            self._held = False
            b = self.backend
            b.load.end_leg()
            if b.load.outstanding == 0 and b.idle is not None:
                b.idle.set()


class Backends:
    """All P and D backends of one router."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._probing = config.mode is Mode.PUSH
        self.chooser = Chooser(
            config.policy, stale_s=3 * config.signals_interval_s, max_imbalance=config.max_imbalance
        )
        self.prefill: list[Backend] = []
        self.decode: list[Backend] = []
        # Indexes are never reused: a removed backend's index stays unknown (failed-this-
        # request sets, prefix tables and admin paths name backends by it).
        self._next_index = {Role.PREFILL: 0, Role.DECODE: 0}
        for url, override in zip(config.prefill_urls, config.prefill_overrides, strict=True):
            self._new(Role.PREFILL, url, override)
        for url in config.decode_urls:
            self._new(Role.DECODE, url)
        self._loop_task: asyncio.Task[None] | None = None
        self._signals_task: asyncio.Task[None] | None = None
        self._started = False

    def _new(self, role: Role, url: str, override: CoordOverride | None = None) -> Backend:
        i = self._next_index[role]
        self._next_index[role] = i + 1
        override = override or CoordOverride()
        coords = override.apply(None) if role is Role.PREFILL else None
        ready = role is Role.DECODE or coords is not None or not self._probing
        b = Backend(
            role, i, url, BackendLoad(i, ready=ready, key=url), override=override, coords=coords
        )
        self.pool(role).append(b)
        return b

    def pool(self, role: Role) -> list[Backend]:
        return self.prefill if role is Role.PREFILL else self.decode

    @property
    def all(self) -> list[Backend]:
        return self.prefill + self.decode

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Create the clients, run one health round (so a router whose backends are up is
        ready when it starts listening), then keep checking in the background."""
        for b in self.all:
            await self._open(b)
        await self.check_all()
        self._loop_task = asyncio.create_task(self._health_loop(), name="pushkv-router-health")
        if self.config.policy.needs_signals:
            self._signals_task = asyncio.create_task(
                self._signals_loop(), name="pushkv-router-signals"
            )
        self._started = True

    async def _open(self, b: Backend) -> None:
        c = self.config
        b.client = Upstream(
            b.url,
            timeout_s=c.timeout_s,
            connect_timeout_s=c.connect_timeout_s,
            max_connections=c.max_connections,
            keepalive_expiry_s=c.keepalive_expiry_s,
            api_key=c.backend_api_key,
        )
        await b.client.start()

    async def stop(self) -> None:
        for task in (self._loop_task, self._signals_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):  # the cancel just asked for
                    await task
        self._loop_task = self._signals_task = None
        clients = [b.client for b in self.all if b.client is not None]
        await asyncio.gather(*(cl.close() for cl in clients), return_exceptions=True)

    async def _health_loop(self) -> None:
        interval = self.config.health_interval_s
        tick = min(interval, RECHECK_S)
        loop = asyncio.get_running_loop()
        next_round = loop.time() + interval
        while True:
            await asyncio.sleep(tick)  # the schedule, not a sync
            if loop.time() >= next_round:
                next_round = loop.time() + interval
                await self.check_all()
            else:
                await self.recheck_out()

    async def _signals_loop(self) -> None:
        """Each engine's queue and KV usage, every ``--signals-interval`` (each read bounded
        by it too, so a hung /metrics delays no round)."""
        while True:
            await self.read_signals()
            await asyncio.sleep(self.config.signals_interval_s)  # the schedule, not a sync

    async def read_signals(self) -> None:
        """One round of /metrics reads over every backend (concurrently)."""
        timeout = min(self.config.signals_interval_s, self.config.health_timeout_s)
        await asyncio.gather(
            *(signals.scrape(b, timeout) for b in self.all if not b.removed and b.client),
            return_exceptions=True,  # a backend removed meanwhile: its client closed
        )

    def _out(self, b: Backend) -> bool:
        """Out of service: not healthy (suspect is still in service), or a P the router
        cannot route to yet (coordinates unknown)."""
        if b.load.health not in (Health.HEALTHY, Health.SUSPECT):
            return True
        return b.role is Role.PREFILL and self._probing and b.coords is None

    # -- health and probe --------------------------------------------------------------

    async def check_all(self) -> None:
        """One health round over every backend (concurrently)."""
        await asyncio.gather(*(self._check(b) for b in self.all))

    async def recheck_out(self) -> None:
        """Check again the backends out of service (``RECHECK_S``'s round); one whose check
        in flight brings it back is skipped."""
        await asyncio.gather(*(self._check(b, only_if_out=True) for b in self.all if self._out(b)))

    async def _check(self, b: Backend, *, only_if_out: bool = False) -> None:
        async with b.checking:
            if only_if_out and not self._out(b):
                return
            await self._check_now(b)

    async def _check_now(self, b: Backend) -> None:
        if b.removed or b.client is None:  # forgotten, or added and its client not open yet
            return
        before = b.load.health
        answered = True
        try:
            r = await b.http.request("GET", "/health", timeout_s=self.config.health_timeout_s)
            ok = r.status_code == 200
        except TransportError as exc:
            # a timeout: maybe just a loaded host, tolerated a few times
            ok, answered = False, exc.kind != "timeout"
        except RuntimeError:
            if b.removed:  # forgotten while its check was on the wire
                return
            raise
        came_back = b.load.record_health(ok, answered=answered)
        if b.load.health is Health.DOWN and before is not Health.DOWN:
            # Back from down it may be a new process: its prefix cache is cold.
            self.chooser.table(b.role.value).forget(b.index)
        if b.load.health is not before:
            log = logger.info if ok else logger.warning
            log("router backend %s: %s -> %s", b.name, before.value, b.load.health.value)
        if b.role is not Role.PREFILL or not self._probing or b.override.complete:
            return
        if not ok:
            # A P that went away may come back as a new engine: forget what it told us.
            b.coords, b.load.ready = None, False
        elif came_back or b.coords is None:
            probed = await self._probe(b)
            b.coords = b.override.apply(probed)
            b.load.ready = b.coords is not None
            if b.coords is not None:
                logger.info(
                    "router backend %s: transfer coordinates %s", b.name, b.coords.as_dict()
                )

    async def _probe(self, b: Backend) -> PrefillCoords | None:
        """Ask P (pushkv's connector) where its KV lives: a one-token completion whose
        answer carries ``kv_transfer_params.pushkv``."""
        t = self.config.probe_timeout_s
        try:
            r = _ok(await b.http.request("GET", "/v1/models", timeout_s=t))
            model = legs.parse_models_response(r.json())
            r = await b.http.request(
                "POST",
                "/v1/completions",
                body=legs.probe_body(model),
                timeout_s=t,
                headers={"X-Request-Id": f"pushkv-probe-{uuid.uuid4().hex}"},
            )
            return legs.parse_probe_response(_ok(r).json())
        except (TransportError, ValueError, RemoteProtocolError) as exc:
            logger.warning("router backend %s: probe failed: %s", b.name, exc)
            return None

    # -- choice ------------------------------------------------------------------------

    def acquire(
        self, role: Role, exclude: frozenset[int] = frozenset(), prefix: tuple[int, ...] = ()
    ) -> Lease | None:
        """Choose a backend for one leg (``--policy``) and count the leg at once (before any
        await), so concurrent requests see each other. ``exclude``: indexes this request
        already failed on; ``prefix``: the prompt's block hashes (prefix policy). A push-mode
        P whose coordinates are gone is not eligible."""
        pool = self.pool(role)
        needs_coords = role is Role.PREFILL and self.config.mode is not Mode.PULL
        by_index = {
            b.index: b
            for b in pool
            if b.index not in exclude and not (needs_coords and b.coords is None)
        }
        now = asyncio.get_running_loop().time()
        choice = self.chooser.choose(role.value, (b.load for b in by_index.values()), prefix, now)
        return Lease(by_index[choice.load.index], choice) if choice is not None else None

    def find(self, role: Role, key: str) -> Backend | None:
        """The backend of ``role`` named by its index (``0``) or its URL, else None."""
        pool = self.pool(role)
        if key.isdigit():
            return next((b for b in pool if b.index == int(key)), None)
        return next((b for b in pool if b.url == key.rstrip("/")), None)

    def set_draining(self, b: Backend, draining: bool) -> None:
        """Take ``b`` out of rotation (no new legs; those in flight run on) or back in."""
        if b.load.draining is not draining:
            b.load.draining = draining
            logger.warning(
                "router backend %s: %s (%d leg(s) in flight)",
                b.name,
                "draining: no new legs" if draining else "undrained: back in rotation",
                b.load.outstanding,
            )

    # -- membership (admin API: membership.py) -----------------------------------------

    async def add(self, role: Role, url: str, override: CoordOverride | None = None) -> Backend:
        """A new backend, checked (and, a push-mode P, probed) once before this returns: it
        gets legs only once healthy (and probed), like one given at start-up."""
        b = self._new(role, url, override)
        logger.warning("router backend %s: added", b.name)
        if self._started:
            async with b.checking:  # taken before any await: the recheck loop waits for it
                await self._open(b)
                await self._check_now(b)
        return b

    async def remove(self, b: Backend) -> None:
        """Forget ``b`` (its legs must be over: drain first); its client is closed."""
        pool = self.pool(b.role)
        if b in pool:
            pool.remove(b)
        b.removed = True
        self.chooser.table(b.role.value).forget(b.index)
        logger.warning("router backend %s: removed", b.name)
        if b.client is not None:
            await b.client.close()

    def pick(self, role: Role) -> Backend | None:
        """A backend for a request that is not a leg (``/v1/models``): not counted."""
        pool = self.pool(role)
        picked = choose(b.load for b in pool)
        return next(b for b in pool if b.load is picked) if picked is not None else None

    def unavailable_reason(self) -> str | None:
        return unavailable_reason([b.load for b in self.prefill], [b.load for b in self.decode])

    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.config.policy.value,
            "prefill": [b.stats() for b in self.prefill],
            "decode": [b.stats() for b in self.decode],
        }


def _ok(reply: Reply) -> Reply:
    if reply.status_code >= 400:
        raise RemoteProtocolError(f"answered {reply.status_code}")
    return reply
