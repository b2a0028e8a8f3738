"""The metadata side channel: peers swap NIXL agent metadata over one TCP round trip.

Owns: the server thread that answers exchanges on ``listen_host:port`` only, the
single client worker that dials peers, and the inbox through which both hand received
metadata to the owning thread.
Must not import: nixl, torch, vLLM, or other pushkv modules except ``core.errors``,
``core.auth`` and its wire codec (``sidechannel_wire.py``).
Nothing here calls NIXL: the owner (``NixlTransport``, on the transfer thread) drains
``drain()`` and loads what it gets, because NIXL is called from one thread only.

Wire (version 1), both directions the same frame:
    magic b"PKSC" | version u8 | kind u8 | name_len u16 | md_len u32 | name | metadata
A client sends EXCHANGE (its name and metadata); the server queues them and answers
REPLY (its name and current metadata), then closes. Anything else (wrong magic or
version, unknown kind, oversized, truncated, stalled) closes the connection and is
counted under ``Count.SIDE_DROPPED`` (``dropped_<reason>``); the server never stops serving
for it.

With a shared secret (``key``), the metadata field of both frames is sealed
(``connector/core/auth.py``): the request's tag covers its agent name, the reply's also the
request's nonce (a recorded reply answers no other request). A request that fails
authentication is dropped (``dropped_auth_<reason>``) without an answer, so neither its
metadata is loaded nor ours handed out; a reply that fails it fails the dial.
"""

from __future__ import annotations

import logging
import queue
import secrets
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import connector.core.auth as auth
from connector.core.errors import LocalProtocolError, RemoteProtocolError, TransportError
from connector.transport.sidechannel_wire import (
    KIND_EXCHANGE,
    KIND_REPLY,
    MAX_METADATA_BYTES,
    Frame,
    FrameReader,
    bad,
    drop_reason,
    encode_frame,
)
from telemetry.schema import Count

logger = logging.getLogger(__name__)

# -- what the owner drains ----------------------------------------------------------------


@dataclass(frozen=True)
class PeerMetadata:
    """Metadata of ``peer``: it dialed us ("dialed_us"), or answered our dial ("reply")."""

    peer: str
    metadata: bytes
    via: Literal["dialed_us", "reply"]


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    deadline_s: float
    reader: FrameReader
    out: memoryview | None = None  # the reply, once the request is in


class SideChannel:
    """Server + client of the metadata exchange for one agent.

    Threads: one server thread (blocks in select, woken by a socketpair to stop) and
    up to ``dial_workers`` client workers (a pool; idle threads block on its queue): an
    idle side channel burns no CPU. They only touch sockets, the inbox and the counters.
    A peer has at most one dial queued or in flight (``request`` coalesces), so a peer that
    never answers holds one worker for at most its connect and I/O timeouts, and dials to
    other peers go on beside it.
    """

    def __init__(
        self,
        agent_name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        connect_timeout_s: float = 1.0,
        io_timeout_s: float = 1.0,
        max_metadata_bytes: int = MAX_METADATA_BYTES,
        max_conns: int = 32,
        key: bytes | None = None,
        auth_window_s: float = 120.0,
        dial_workers: int = 4,
    ) -> None:
        self.name = agent_name
        self._key = auth.check_key(key) if key is not None else None
        self._window_ms = int(auth_window_s * 1000)
        self._replay = auth.ReplayWindow(self._window_ms)  # server thread only
        self._connect_timeout_s = connect_timeout_s
        self._io_timeout_s = io_timeout_s
        self._max = max_metadata_bytes
        self._max_conns = max_conns
        # Swapped whole by the owner (one attribute store: atomic under the GIL); the
        # server thread reads it once per reply, so a reply is never half old, half new.
        self._local_md = b""
        self._inbox: queue.SimpleQueue[PeerMetadata] = queue.SimpleQueue()
        self._lock = threading.Lock()  # counters, pending dials, last errors
        self._counters: dict[str, int] = {}
        self._pending: set[tuple[str, str, int]] = set()
        self._last_error: dict[str, str] = {}
        self._refused: dict[str, str] = {}  # peer -> why its latest dial was refused
        self._closed = False
        try:
            # Bound to the configured host only, never 0.0.0.0 (NIXL's listener's flaw).
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._lsock = socket.create_server((host, port), family=family, backlog=64)
        except OSError as exc:
            raise TransportError(f"side channel: cannot listen on {host}:{port}: {exc}") from exc
        self._lsock.setblocking(False)
        self.address: tuple[str, int] = (host, int(self._lsock.getsockname()[1]))
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._conns: dict[socket.socket, _Conn] = {}
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._lsock, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._server = threading.Thread(
            target=self._serve, daemon=True, name=f"pushkv-sidechannel-{agent_name}"
        )
        self._server.start()
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, dial_workers), thread_name_prefix=f"pushkv-dial-{agent_name}"
        )

    # -- owner API ------------------------------------------------------------------

    def set_local_metadata(self, metadata: bytes) -> None:
        """What we send when dialing and answer when dialed (call after every change)."""
        if len(metadata) > self._max:
            raise LocalProtocolError(f"local metadata is {len(metadata)} B (cap {self._max})")
        self._local_md = bytes(metadata)

    def request(self, peer: str, host: str, port: int) -> None:
        """Exchange metadata with ``peer`` in the background (fire-and-forget). A dial to
        the same peer and address already queued or in flight absorbs this one, so a
        fast retry loop cannot pile up work behind a slow peer."""
        key = (peer, host, int(port))
        with self._lock:
            if self._closed or key in self._pending:
                return
            self._pending.add(key)
            self._refused.pop(peer, None)  # this dial's own answer decides now
        self._pool.submit(self._dial, key)

    def drain(self) -> list[PeerMetadata]:
        """Everything received since the last call, oldest first (owner thread)."""
        out: list[PeerMetadata] = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def last_error(self, peer: str) -> str | None:
        """Why the latest dial to ``peer`` failed (for PeerUnreachable messages)."""
        with self._lock:
            if peer in self._last_error:
                return self._last_error[peer]
            if any(key[0] == peer for key in self._pending):
                return "a dial is in flight, no answer yet"
            return None

    def refused(self, peer: str) -> str | None:
        """Why the latest dial to ``peer`` was refused (nothing listens there: the peer's
        process is gone), or None. Cleared when a new dial to it is queued."""
        with self._lock:
            return self._refused.get(peer)

    @property
    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def close(self) -> None:
        """Stop both threads and join them (a dial in flight ends within its timeouts);
        what they received and nobody drained yet is dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # the server is gone already; join below returns at once
        self._server.join(5.0)
        if self._server.is_alive():
            logger.warning("Side channel server of %s did not stop within 5 s", self.name)
            return  # leave its sockets to it rather than close them under its feet
        for sock in (*self._conns, self._lsock, self._wake_r, self._wake_w):
            sock.close()
        self._conns.clear()
        self._sel.close()
        self.drain()

    def _count(self, name: Count, detail: str = "") -> None:
        key = name.value + detail
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + 1  # written by both threads

    # -- client worker --------------------------------------------------------------

    def _dial(self, key: tuple[str, str, int]) -> None:
        peer, host, port = key
        try:
            reply = self._exchange(host, port)
            if reply.kind != KIND_REPLY:
                raise bad("bad_kind", f"expected a reply, got kind {reply.kind}")
            if reply.name != peer:  # someone else listens there (a port reused)
                raise bad("wrong_peer", f"answered as {reply.name!r}")
            self._inbox.put(PeerMetadata(peer, reply.metadata, "reply"))
            self._count(Count.SIDE_DIALS_OK)
            with self._lock:
                self._last_error.pop(peer, None)
                self._refused.pop(peer, None)
        except (OSError, RemoteProtocolError) as exc:
            if isinstance(exc, RemoteProtocolError):
                reason, text = drop_reason(exc), f"{drop_reason(exc)}: {exc.args[-1]}"
            else:
                reason, text = "unreachable", f"{type(exc).__name__}: {exc}"
            self._count(Count.SIDE_DIALS_FAILED, reason)
            with self._lock:
                self._last_error[peer] = f"{host}:{port}: {text}"
                if isinstance(exc, ConnectionRefusedError):
                    self._refused[peer] = self._last_error[peer]
        except Exception:  # a bug of ours: log it, the worker must keep serving
            logger.exception("Side channel dial to %s at %s:%d failed", peer, host, port)
            self._count(Count.SIDE_DIALS_FAILED, "internal")
        finally:
            with self._lock:
                self._pending.discard(key)

    def _cap(self) -> int:
        return self._max + (auth.OVERHEAD if self._key is not None else 0)

    def _seal(self, domain: bytes, md: bytes, aad: bytes) -> tuple[bytes, bytes]:
        """``md`` sealed (with the nonce used) when a secret is set, else as it is."""
        if self._key is None:
            return md, b""
        stamp = auth.Stamp(time.time_ns() // 1_000_000, secrets.token_bytes(auth.NONCE_BYTES))
        return auth.seal(self._key, domain, md, stamp, aad), stamp.nonce

    def _open(
        self, domain: bytes, md: bytes, aad: bytes, replay: auth.ReplayWindow | None
    ) -> tuple[bytes, bytes]:
        """Metadata and nonce of a frame from a peer; ``bad("auth_<reason>")`` if refused."""
        try:
            if self._key is None:
                if auth.is_sealed(md):
                    raise auth.AuthError("unexpected", "sealed, but no secret is configured")
                return md, b""
            now_ms = time.time_ns() // 1_000_000
            body, stamp = auth.unseal(self._key, domain, md, now_ms, self._window_ms, aad, replay)
        except auth.AuthError as exc:
            raise bad(f"auth_{exc.reason}", str(exc)) from None
        return body, stamp.nonce

    def _exchange(self, host: str, port: int) -> Frame:
        md, nonce = self._seal(auth.SIDE_EXCHANGE, self._local_md, self.name.encode())
        request = encode_frame(KIND_EXCHANGE, self.name, md, self._cap())
        deadline = time.monotonic() + self._connect_timeout_s + self._io_timeout_s
        with socket.create_connection((host, port), timeout=self._connect_timeout_s) as s:
            s.settimeout(self._io_timeout_s)
            s.sendall(request)
            reader = FrameReader(self._cap())
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("timed out: no full reply by the exchange deadline")
                s.settimeout(min(self._io_timeout_s, left))
                chunk = s.recv(min(max(reader.wanted, 1), 1 << 20))
                if not chunk:
                    raise bad("truncated", f"closed with {reader.wanted} bytes missing")
                frame = reader.feed(chunk)
                if frame is not None:
                    aad = frame.name.encode() + nonce
                    md, _ = self._open(auth.SIDE_REPLY, frame.metadata, aad, None)
                    return Frame(frame.kind, frame.name, md)

    # -- server thread --------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            # Block until something happens; wake only for the nearest stalled-client
            # deadline (no periodic tick: an idle server costs nothing).
            timeout = None
            if self._conns:
                timeout = max(
                    0.0, min(c.deadline_s for c in self._conns.values()) - time.monotonic()
                )
            for key, mask in self._sel.select(timeout):
                sock = key.fileobj
                if sock is self._wake_r:
                    return
                if sock is self._lsock:
                    self._accept()
                    continue
                conn = self._conns[sock]  # type: ignore[index]
                try:
                    (self._on_readable if mask & selectors.EVENT_READ else self._on_writable)(conn)
                except Exception:  # a bug of ours: lose this request, never the server
                    logger.exception("Side channel of %s failed on a request", self.name)
                    if conn.sock in self._conns:
                        self._drop(conn, "internal")
            now = time.monotonic()
            for conn in [c for c in self._conns.values() if c.deadline_s <= now]:
                self._drop(conn, "stalled")

    def _accept(self) -> None:
        try:
            sock, _ = self._lsock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # e.g. EMFILE: keep serving, the client retries
            logger.warning("Side channel of %s: accept failed: %s", self.name, exc)
            self._count(Count.SIDE_ACCEPT_FAILED)
            return
        if len(self._conns) >= self._max_conns:
            sock.close()
            self._count(Count.SIDE_DROPPED, "busy")
            return
        sock.setblocking(False)
        # A whole exchange must finish in this time: a stalled client cannot hold a slot.
        deadline = time.monotonic() + self._connect_timeout_s + self._io_timeout_s
        self._conns[sock] = _Conn(sock, deadline, FrameReader(self._cap()))
        self._sel.register(sock, selectors.EVENT_READ)

    def _on_readable(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(min(max(conn.reader.wanted, 1), 1 << 20))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn, "reset")
            return
        if not chunk:
            self._drop(conn, "truncated")
            return
        try:
            frame = conn.reader.feed(chunk)
        except RemoteProtocolError as exc:
            logger.info("Side channel of %s dropped a request: %s", self.name, exc.args[-1])
            self._drop(conn, drop_reason(exc))
            return
        if frame is None:
            return
        if frame.kind != KIND_EXCHANGE:
            self._drop(conn, "bad_kind")
            return
        try:
            md, nonce = self._open(
                auth.SIDE_EXCHANGE, frame.metadata, frame.name.encode(), self._replay
            )
        except RemoteProtocolError as exc:
            self._drop(conn, drop_reason(exc))
            n = self.counters.get(Count.SIDE_DROPPED.value + drop_reason(exc), 0)
            if n & (n - 1) == 0:  # 1st, 2nd, 4th...: a flood stays quiet
                logger.warning(
                    "Side channel of %s refused %r: %s (%d so far)",
                    self.name,
                    frame.name,
                    exc.args[-1],
                    n,
                )
            return
        self._inbox.put(PeerMetadata(frame.name, md, "dialed_us"))
        self._count(Count.SIDE_SERVED)
        reply, _ = self._seal(auth.SIDE_REPLY, self._local_md, self.name.encode() + nonce)
        conn.out = memoryview(encode_frame(KIND_REPLY, self.name, reply, self._cap()))
        self._sel.modify(conn.sock, selectors.EVENT_WRITE)
        self._on_writable(conn)

    def _on_writable(self, conn: _Conn) -> None:
        assert conn.out is not None
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn, "reset")
            return
        conn.out = conn.out[sent:]
        if not conn.out:
            self._close_conn(conn)

    def _drop(self, conn: _Conn, reason: str) -> None:
        self._count(Count.SIDE_DROPPED, reason)
        self._close_conn(conn)

    def _close_conn(self, conn: _Conn) -> None:
        self._sel.unregister(conn.sock)
        del self._conns[conn.sock]
        conn.sock.close()
