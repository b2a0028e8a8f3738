"""The NIXL adapter: the only module of pushkv that calls NIXL.

Owns: ``NixlTransport`` (the ``Transport`` Protocol over a NIXL agent) and loading the peer
metadata that our side channel (``transport/sidechannel.py``) receives. The nixl wheel is
found, and its exceptions mapped onto ``connector.core.errors``, by ``nixl_api.py``.
Must not import at module level: nixl, torch, vLLM (this module must import cheaply
where nixl is not installed). NIXL runs no threads: its listener is off (it binds
0.0.0.0, never retries, and loads metadata from its own thread) and so is its progress
thread, so UCX makes progress only inside our calls (``poll_write``, ``get_notifs``,
``write``). The side channel's two threads never call NIXL; every NIXL call here is
made by the thread that owns the transport (the transfer thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from connector.core.errors import (
    LocalProtocolError,
    PeerDisconnected,
    PeerUnknown,
    PeerUnreachable,
    TransportError,
)
from connector.transport.base import (
    DialBook,
    WriteHandle,
    check_mem_kind,
    extents_to_rows,
    tensor_extents,
    validate_write_descs,
)
from connector.transport.nixl_api import load_nixl_api, nixl_call
from connector.transport.sidechannel import SideChannel
from telemetry.counts import Counts
from telemetry.schema import Count

logger = logging.getLogger(__name__)


class NixlTransport:
    """``Transport`` over one NIXL agent; its side channel listens on ``listen_host:
    listen_port`` only (port 0: an ephemeral port, see ``listen_address``).

    Metadata a peer sends us (it dialed us) or answers us (we dialed it) is loaded on
    the owner's next ``progress``/``get_notifs``/``peer_ready``/``poll_peer``. A peer whose
    metadata changed under the same name (restarted, or registered more memory) is
    removed, then loaded: NIXL refuses new connection info over old (NIXL_ERR_NOT_ALLOWED,
    and the old entry is left unusable)."""

    def __init__(
        self,
        agent_name: str,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        backends: Sequence[str] = ("UCX",),
        num_workers: int | None = None,
        side_timeout_s: float = 1.0,
        secret: bytes | None = None,
        auth_window_s: float = 120.0,
    ) -> None:
        """``secret``: the P/D plane's shared secret; the side channel then answers and
        loads only authenticated metadata (``connector/transport/sidechannel.py``)."""
        api = load_nixl_api()
        self._name = agent_name
        # No progress thread (it busy-polls a core; we drive progress) and no listener
        # (the side channel replaces it). Backends are created explicitly (not via the
        # config) so a missing plugin fails here instead of being skipped with a warning,
        # and so UCX gets num_workers.
        cfg = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            capture_telemetry=False,
            backends=[],
        )
        with nixl_call("create agent"):
            agent = api.nixl_agent(agent_name, cfg)
            plugins = agent.get_plugin_list()
            for backend in backends:
                if backend not in plugins:
                    raise TransportError(
                        f"create agent: NIXL plugin {backend!r} not found (have {plugins})"
                    )
                params: dict[str, str] = {}
                if backend == "UCX" and num_workers is not None:
                    params["num_workers"] = str(num_workers)
                agent.create_backend(backend, params)
        self._side = SideChannel(
            agent_name,
            listen_host,
            listen_port,
            connect_timeout_s=side_timeout_s,
            io_timeout_s=side_timeout_s,
            key=secret,
            auth_window_s=auth_window_s,
        )
        self._agent: Any = agent
        self._loaded: dict[str, bytes] = {}  # peer -> the metadata bytes we loaded for it
        self.counters: Counts = Counts()  # metadata loads, by outcome
        self._regs: list[Any] = []  # nixlRegDList per register call, for deregistration
        self._handles: set[WriteHandle] = set()
        self._inbox: list[tuple[str, bytes]] = []  # arrived during progress, not yet taken
        self._connected: set[str] = set()  # peers we already asked UCX to connect to
        self._dials = DialBook(self._fire_request, self.peer_ready)
        self._publish()

    # -- identity -------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def listen_address(self) -> tuple[str, int]:
        """The side channel's bound (host, port): the real port when asked for 0."""
        return self._side.address

    @property
    def side_channel_counters(self) -> dict[str, int]:  # dials and dropped requests
        return self._side.counters

    def _live_agent(self) -> Any:
        if self._agent is None:
            raise TransportError(f"transport {self._name!r} is closed")
        return self._agent

    # -- memory ---------------------------------------------------------------------

    def register_memory(
        self, extents: Sequence[tuple[int, int]], mem_type: str = "DRAM", device_id: int = 0
    ) -> None:
        agent = self._live_agent()
        rows = extents_to_rows(extents, device_id)
        if rows.shape[0] == 0:
            return
        with nixl_call(f"register {rows.shape[0]} {check_mem_kind(mem_type)} extents"):
            self._regs.append(agent.register_memory(rows, mem_type))
        self._publish()

    def register_tensors(self, tensors: Sequence[Any]) -> None:
        for (mem_type, device_id), extents in tensor_extents(tensors).items():
            self.register_memory(extents, mem_type, device_id)

    def deregister_all(self) -> None:
        agent = self._live_agent()
        first: TransportError | None = None
        while self._regs:
            reg = self._regs.pop()
            try:
                with nixl_call("deregister memory"):
                    agent.deregister_memory(reg)
            except TransportError as exc:
                first = first or exc
        self._publish()
        if first is not None:
            raise first

    def _publish(self) -> None:
        """Our current metadata to the side channel: what every later exchange carries."""
        with nixl_call("get local metadata"):
            self._side.set_local_metadata(self._live_agent().get_agent_metadata())

    # -- peers ----------------------------------------------------------------------

    def _fire_request(self, peer: str, host: str, port: int) -> None:
        self._live_agent()
        self._side.request(peer, host, port)  # one round trip carries both directions

    def _load_received(self) -> None:
        """Load what the side channel received. A bad or misnamed blob is the peer's fault:
        counted and logged, never raised (the dial retries, then times out)."""
        for got in self._side.drain():
            if self._loaded.get(got.peer) == got.metadata:
                self.counters.add(Count.MD_UNCHANGED)  # a peer dialing until it is ready
                continue
            try:
                self._load(got.peer, got.metadata)
            except TransportError as exc:
                self.counters.add(Count.MD_REJECTED)
                logger.warning("Metadata of %s (%s) not loaded: %s", got.peer, got.via, exc)

    def _load(self, peer: str, metadata: bytes) -> None:
        agent = self._live_agent()
        if peer in self._loaded:
            self.counters.add(Count.MD_RELOADED)
            self._unload(peer, "its metadata changed (restarted or re-registered)")
        with nixl_call("load metadata", peer):
            got = agent.add_remote_agent(metadata)
        name = got.decode("utf-8", "replace") if isinstance(got, bytes) else str(got)
        if name != peer:
            self.counters.add(Count.MD_NAME_MISMATCH)
            if name not in self._loaded:  # don't keep an agent nobody asked for
                with nixl_call("unload misnamed metadata", name):
                    agent.remove_remote_agent(name)
            raise TransportError(f"load metadata (peer {peer!r}): it names agent {name!r}")
        self._loaded[peer] = metadata
        self.counters.add(Count.MD_LOADED)

    def _unload(self, peer: str, why: str | None) -> None:
        """Release the peer's handles, forget its metadata. Unfinished WRITEs fail at their
        next poll: PeerDisconnected once the peer is removed; on a reload (``why``) not,
        as its handling (Peers.lost) would remove the metadata just loaded."""
        for handle in [h for h in self._handles if h.peer == peer]:
            if not handle.done and handle.error is None:
                handle.error = (
                    TransportError(f"write (peer {peer!r}): reloaded, {why}")
                    if why
                    else PeerDisconnected(f"write (peer {peer!r}): peer removed in flight")
                )
            self._release_logged(handle)
        self._connected.discard(peer)
        self._loaded.pop(peer, None)
        try:
            with nixl_call("remove peer", peer):
                self._live_agent().remove_remote_agent(peer)
        except PeerUnknown:
            pass  # never loaded, or already removed: removing is idempotent

    def request_peer(
        self, peer: str, host: str, port: int, *, retry_interval_s: float = 0.05
    ) -> None:
        self._dials.request(peer, host, port, retry_interval_s, time.monotonic())

    def peer_ready(self, peer: str) -> bool:
        agent = self._live_agent()
        self._load_received()
        ready = peer in self._loaded
        if ready and peer not in self._connected:
            # Eager UCX wire-up, so the first WRITE does not pay the lazy connect.
            self._connected.add(peer)
            with nixl_call("make connection", peer):
                agent.make_connection(peer)
        return ready

    def poll_peer(self, peer: str, now_s: float) -> bool:
        self.progress()  # a dialing loop also wires up endpoints already connecting
        return self._dials.poll(peer, now_s)

    def dial_refused(self, peer: str) -> str | None:
        return self._side.refused(peer)

    def connect(
        self, peer: str, host: str, port: int, timeout_s: float, retry_interval_s: float = 0.05
    ) -> None:
        try:
            self._dials.connect(peer, host, port, timeout_s, retry_interval_s, poll=self.poll_peer)
        except PeerUnreachable as exc:
            last = self._side.last_error(peer)
            raise PeerUnreachable(f"{exc}; last: {last}" if last else str(exc)) from None

    def remove_peer(self, peer: str) -> None:
        self._live_agent()
        self._dials.forget(peer)
        self._unload(peer, None)

    # -- writes ---------------------------------------------------------------------

    def write(
        self,
        peer: str,
        src: np.ndarray,
        dst: np.ndarray,
        notif: bytes,
        *,
        src_mem: str = "DRAM",
        dst_mem: str = "DRAM",
    ) -> WriteHandle:
        agent = self._live_agent()
        src_a, dst_a, nbytes = validate_write_descs(src, dst)
        try:
            with nixl_call("prepare write", peer):
                local = agent.get_xfer_descs(src_a, check_mem_kind(src_mem))
                remote = agent.get_xfer_descs(dst_a, check_mem_kind(dst_mem))
                xfer = agent.initialize_xfer("WRITE", local, remote, peer, notif_msg=notif)
        except PeerUnknown as exc:
            # NIXL_ERR_NOT_FOUND here means either "no metadata for the peer" or "no
            # backend has registrations covering these descriptors"; tell them apart.
            if self.peer_ready(peer):
                raise TransportError(
                    f"prepare write (peer {peer!r}): descriptors outside "
                    f"registered memory (NIXL_ERR_NOT_FOUND)"
                ) from exc.__cause__
            raise
        handle = WriteHandle(peer, nbytes, int(src_a.shape[0]), time.time_ns(), native=xfer)
        self._handles.add(handle)
        try:
            with nixl_call("post write", peer):
                # NIXL documents "ERR" as a return but raises instead; handle both.
                state = agent.transfer(xfer, notif_msg=notif)
                if state == "ERR":
                    raise TransportError(f"post write (peer {peer!r}): state ERR")
        except TransportError as exc:
            handle.error = exc
            self._release_logged(handle)
            # Don't let the raised traceback keep the xfer (and through it the C++
            # agent) alive until some later GC; and let UCX retire the failed request
            # now (destroying an agent that still queues one aborts the process).
            xfer = None
            self._drain(1)
            raise
        handle.done = state == "DONE"
        return handle

    def poll_write(self, handle: WriteHandle) -> bool:
        if handle.error is not None:
            raise handle.error
        if handle.done:
            return True
        if handle.released:
            raise LocalProtocolError("poll_write on a released, unfinished handle")
        agent = self._live_agent()
        try:
            with nixl_call("poll write", handle.peer):
                state = agent.check_xfer_state(handle.native)
                if state == "ERR":
                    raise TransportError(f"poll write (peer {handle.peer!r}): state ERR")
        except TransportError as exc:
            handle.error = exc
            self._drain(1)
            raise
        handle.done = state == "DONE"
        return handle.done

    def release(self, handle: WriteHandle) -> None:
        if handle.released:
            return
        with nixl_call("release write", handle.peer):
            # Releasing an unfinished WRITE asks NIXL to cancel it; if it cannot, it
            # raises and the handle stays ours (close() tries again).
            handle.native.release()
        handle.released = True
        handle.native = None
        self._handles.discard(handle)

    def _release_logged(self, handle: WriteHandle) -> None:
        try:
            self.release(handle)
        except TransportError as exc:
            logger.warning("Could not release WRITE to %s: %s", handle.peer, exc)

    # -- notifications --------------------------------------------------------------

    def send_notif(self, peer: str, msg: bytes) -> None:
        agent = self._live_agent()
        with nixl_call("send notif", peer):
            agent.send_notif(peer, msg)
        # Once the endpoint is wired up the message leaves inside genNotif; before that
        # it waits for progress, so give it one now.
        self.progress()

    def get_notifs(self) -> list[tuple[str, bytes]]:
        self.progress()
        out, self._inbox = self._inbox, []
        return out

    def progress(self) -> None:
        """Drive UCX progress (get_new_notifs is the call that does it); what arrives is
        kept for the next get_notifs, so progress can be driven from anywhere."""
        agent = self._live_agent()
        self._load_received()  # cheap when empty: one queue check
        with nixl_call("get notifs"):
            new = agent.get_new_notifs()
        if new:
            self._inbox.extend((peer, bytes(m)) for peer, msgs in new.items() for m in msgs)

    def _drain(self, rounds: int) -> None:
        """A few progress rounds, so UCX retires failed/cancelled requests: an agent
        destroyed right after a WRITE failed on a dead peer, with no progress between,
        aborts in UCX (``ucs_arbiter_group_is_empty(group)`` assertion)."""
        for _ in range(rounds):
            try:
                self.progress()
            except TransportError as exc:
                logger.warning("Progress on %s failed while draining: %s", self._name, exc)
                return

    # -- teardown -------------------------------------------------------------------

    def close(self) -> None:
        if self._agent is None:
            return
        self._side.close()  # first: nothing arrives to load while we tear down
        for handle in list(self._handles):
            self._release_logged(handle)
        self._drain(10)
        try:
            self.deregister_all()
        except TransportError as exc:
            logger.warning("Deregistering memory of %s failed: %s", self._name, exc)
        for peer in set(self._dials.peers()) | self._connected | set(self._loaded):
            try:
                self.remove_peer(peer)
            except TransportError as exc:
                logger.warning("Removing peer %s from %s failed: %s", peer, self._name, exc)
        self._drain(10)
        # Dropping the last reference destroys the C++ agent.
        self._agent = None
        self._handles.clear()

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
