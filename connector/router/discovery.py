"""Membership from a watched file (``--members-file``), which may name DNS names.

Owns: ``parse_members`` (the file's text -> its entries; pure), ``Entry``, ``resolve``
(an entry -> its URLs: itself, or one per address a ``dns://NAME:PORT`` name has now, as a
Kubernetes headless service gives) and ``Discovery`` (every ``--members-interval``: read
the file, resolve it, add what is new through ``Backends.add``, drain what is gone and
forget it once its legs are over).

The file, one backend per line (``#`` starts a comment)::

    prefill http://10.0.0.5:8100
    decode  dns://pushkv-decode.default.svc.cluster.local:8200

Discovery manages only the backends it added: those given by ``--prefill`` / ``--decode`` or
through the admin API stay (one it lists that the admin API removes comes back at the next
round: the file wins). A file that cannot be read or parsed, or a name that does not
resolve, changes nothing that round (a typo never empties the router). The last D is
never removed.

Must not import: starlette, uvicorn, ``connector.router.app`` / ``relay``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from connector.router.backends import Backend, Backends, Role
from connector.router.config import RouterConfig, check_url

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    role: Role
    url: str  # http(s)://host:port, or dns://name:port
    line: int

    @property
    def is_dns(self) -> bool:
        return self.url.startswith("dns://")


def parse_members(text: str) -> list[Entry]:
    """The file's entries; ``ValueError`` naming the first bad line."""
    out: list[Entry] = []
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"line {n}: want 'prefill|decode URL', got {raw.strip()!r}")
        role_name, url = parts
        try:
            role = Role(role_name)
        except ValueError:
            raise ValueError(f"line {n}: role {role_name!r} is not prefill or decode") from None
        if url.startswith("dns://"):
            u = urlsplit(url)
            if not u.hostname or u.port is None or u.path not in ("", "/"):
                raise ValueError(f"line {n}: want dns://NAME:PORT, got {url!r}")
            url = f"dns://{u.hostname}:{u.port}"
        else:
            try:
                url = check_url(url)
            except Exception as exc:
                raise ValueError(f"line {n}: {exc}") from None
        out.append(Entry(role, url, n))
    return out


def url_of(address: str, port: int) -> str:
    """``http://`` URL of one resolved address (an IPv6 one in brackets)."""
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"http://{host}:{port}"


async def resolve(entry: Entry) -> set[str]:
    """The URLs an entry names now (``OSError`` when its name does not resolve)."""
    if not entry.is_dns:
        return {entry.url}
    u = urlsplit(entry.url)
    assert u.hostname is not None and u.port is not None
    infos = await asyncio.get_running_loop().getaddrinfo(
        u.hostname, u.port, type=socket.SOCK_STREAM
    )
    return {url_of(str(info[4][0]), u.port) for info in infos}


class Discovery:
    """Keeps ``backends`` in step with the members file."""

    def __init__(self, backends: Backends, path: str, interval_s: float) -> None:
        self.backends, self.path, self.interval_s = backends, Path(path), interval_s
        self.managed: dict[Role, dict[str, Backend]] = {Role.PREFILL: {}, Role.DECODE: {}}
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def of(cls, config: RouterConfig, backends: Backends) -> Discovery | None:
        """The router's discovery when it has a ``--members-file``."""
        if not config.members_file:
            return None
        return cls(backends, config.members_file, config.members_interval_s)

    async def start(self) -> None:
        """One round now (a router started from the file is ready when it listens), then
        one every interval."""
        await self.round()
        self._task = asyncio.create_task(self._loop(), name="pushkv-router-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):  # the cancel just asked for
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)  # the schedule, not a sync
            try:
                await self.round()
            except Exception:  # one bad round must not end discovery
                logger.exception("router members file %s: round failed", self.path)

    async def _desired(self) -> dict[Role, set[str]] | None:
        """Each role's URLs the file names now, or None to change nothing this round."""
        try:
            entries = parse_members(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            logger.warning("router members file %s: %s (membership unchanged)", self.path, exc)
            return None
        out: dict[Role, set[str]] = {Role.PREFILL: set(), Role.DECODE: set()}
        for e in entries:
            try:
                out[e.role] |= await resolve(e)
            except OSError as exc:
                logger.warning(
                    "router members file %s line %d: %s does not resolve (%s); membership "
                    "unchanged",
                    self.path,
                    e.line,
                    e.url,
                    exc,
                )
                return None
        return out

    async def round(self) -> None:
        """Add what the file names and the router lacks; drain what it no longer names,
        and forget each such backend once its legs are over."""
        desired = await self._desired()
        if desired is None:
            return
        for role, urls in desired.items():
            managed = self.managed[role]
            for url in [u for u, b in managed.items() if b.removed]:
                del managed[url]  # removed through the admin API: back next round if listed
            for url in sorted(urls - managed.keys()):
                if self.backends.find(role, url) is None:  # not one of the flags' or admin's
                    managed[url] = await self.backends.add(role, url)
            for url, b in list(managed.items()):
                if url in urls:
                    if b.load.draining:  # listed again before it was forgotten
                        self.backends.set_draining(b, False)
                    continue
                self.backends.set_draining(b, True)
                last_d = role is Role.DECODE and len(self.backends.decode) == 1
                if b.load.outstanding == 0 and not last_d:
                    await self.backends.remove(b)
                    del managed[url]
