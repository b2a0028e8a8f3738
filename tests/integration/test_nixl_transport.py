"""Real NIXL between real processes on loopback: NixlTransport end to end.

The test process is the initiator ("prefill"); targets are spawned children
(tests/integration/nixl_peers.py) that we stop by PID. Every wait has a deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from connector.core.errors import (
    LocalProtocolError,
    PeerDisconnected,
    PeerUnknown,
    PeerUnreachable,
    TransportError,
)
from connector.transport.base import Transport
from connector.transport.nixl_api import load_nixl_api, map_nixl_error
from connector.transport.ports import free_port

try:
    API = load_nixl_api()
except TransportError:
    pytest.skip("nixl is not installed", allow_module_level=True)

from nixl_peers import PeerError, PeerProcess  # noqa: E402

pytestmark = [pytest.mark.nixl]

PIECE = 16 * 1024
CONNECT_S = 20.0  # generous: two busy cores, the listener answers every ~100 ms
FAIL_DETECT_S = 10.0


def wait_write(t: Transport, h: object, timeout_s: float = 10.0) -> float:
    start = time.monotonic()
    while not t.poll_write(h):  # type: ignore[arg-type]
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"WRITE not DONE after {timeout_s}s")
    return time.monotonic() - start


def wait_notifs(t: Transport, count: int, timeout_s: float = 10.0) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"only {len(got)}/{count} notifications after {timeout_s}s")
        got += t.get_notifs()
    return got


def pieces(base: int, idx: list[int]) -> np.ndarray:
    return np.array([[base + i * PIECE, PIECE, 0] for i in idx], dtype=np.uint64)


def source(
    local_transport: Callable[..., Transport], nbytes: int, name: str = "prefill"
) -> tuple[Transport, np.ndarray]:
    t = local_transport(name)
    buf = np.random.default_rng(0).integers(1, 256, nbytes, dtype=np.uint8)
    t.register_memory([(buf.ctypes.data, buf.nbytes)])
    return t, buf


# -- contract pieces that need the wheel but no peer --------------------------------


def test_module_imports_without_loading_nixl() -> None:
    code = (
        "import sys, connector.transport.nixl, connector.transport.fake;"
        "bad=[m for m in sys.modules if m.split('.')[0] in "
        "('nixl','nixl_cu12','nixl_cu13','torch')]; assert not bad, bad"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        timeout=60,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )


def test_missing_wheel_is_a_transport_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import connector.transport.nixl_api as api
    from connector.transport.nixl import NixlTransport

    monkeypatch.setattr(api, "_API_MODULES", ("no_such_nixl._api",))
    with pytest.raises(TransportError, match="pip install nixl==1.5.1"):
        NixlTransport("x", listen_port=0)


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="a GPU host keeps nixl's own pick")
def test_a_cpu_host_loads_nixl_without_torch() -> None:
    """A NIXL rank on a CPU host does not pay for torch (nixl's CUDA probe imports it)."""
    code = (
        "import sys; from connector.transport.nixl_api import load_nixl_api; "
        "api = load_nixl_api(); assert api.nixl_agent; print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_nixl_exceptions_map_onto_ours() -> None:
    b = API.nixlBind
    cases = [
        (b.nixlRemoteDisconnectError, PeerDisconnected),
        (b.nixlNotFoundError, PeerUnknown),
        (b.nixlBackendError, TransportError),
        (b.nixlInvalidParamError, TransportError),
    ]
    for nixl_cls, ours in cases:
        err = map_nixl_error(nixl_cls("boom"), "post write", "decode")
        assert type(err) is ours and "post write" in str(err) and "'decode'" in str(err)


# -- (a) connect both ways, scattered WRITE + notification, bytes verified ------------


def test_scattered_write_with_notification(
    local_transport: Callable[..., Transport], peers: Callable[..., PeerProcess]
) -> None:
    d = peers("decode", nbytes=16 * PIECE)
    p, src = source(local_transport, 12 * PIECE)
    assert isinstance(p, Transport)
    p.connect("decode", "127.0.0.1", d.port, timeout_s=CONNECT_S)
    d.call("connect", "prefill", *p.listen_address, CONNECT_S)
    src_i, dst_i = [0, 3, 4, 5, 9, 2, 10], [7, 1, 2, 3, 0, 11, 15]
    h = p.write("decode", pieces(src.ctypes.data, src_i), pieces(d.addr, dst_i), b"KV_DONE:t1")
    assert (h.bytes_total, h.descs_total) == (len(src_i) * PIECE, len(src_i))
    wait_write(p, h)
    p.release(h)
    p.release(h)
    assert d.call("wait_notifs", 1, 10.0) == [("prefill", b"KV_DONE:t1")]
    dst = np.frombuffer(d.call("read", 0, 16 * PIECE), dtype=np.uint8)
    for s, t in zip(src_i, dst_i, strict=True):
        assert np.array_equal(dst[t * PIECE : (t + 1) * PIECE], src[s * PIECE : (s + 1) * PIECE])
    for t in set(range(16)) - set(dst_i):
        assert not dst[t * PIECE : (t + 1) * PIECE].any(), f"slot {t} was touched"


def test_write_outside_registered_memory_and_bad_shapes(
    local_transport: Callable[..., Transport], peers: Callable[..., PeerProcess]
) -> None:
    d = peers("decode", nbytes=4 * PIECE)
    p, src = source(local_transport, 4 * PIECE)
    p.connect("decode", "127.0.0.1", d.port, timeout_s=CONNECT_S)
    with pytest.raises(TransportError) as info:  # past the end of D's region
        p.write("decode", pieces(src.ctypes.data, [0]), pieces(d.addr, [4]), b"x")
    assert type(info.value) is TransportError and "registered memory" in str(info.value)
    with pytest.raises(PeerUnknown):
        p.write("nobody", pieces(src.ctypes.data, [0]), pieces(d.addr, [0]), b"x")
    with pytest.raises(LocalProtocolError):
        p.write("decode", pieces(src.ctypes.data, [0, 1]), pieces(d.addr, [0]), b"x")


# -- (b) notifications both ways ------------------------------------------------------


def test_notifications_both_directions_in_order(
    local_transport: Callable[..., Transport], peers: Callable[..., PeerProcess]
) -> None:
    d = peers("decode")
    p = local_transport("prefill")
    p.connect("decode", "127.0.0.1", d.port, timeout_s=CONNECT_S)
    # No connect from D: our request_peer pushed our metadata to D's listener, so D can
    # notify us back once it has loaded it.
    msgs = [b"REG:%d" % i for i in range(50)]
    for m in msgs:
        p.send_notif("decode", m)
    # We must drive progress while D waits: the first sends queue until the endpoint is
    # wired up, and only our own NIXL calls move them.
    got = d.call("wait_notifs", len(msgs), 10.0, pump=p.progress)
    assert got == [("prefill", m) for m in msgs]
    for i in range(5):
        d.call("send_notif", "prefill", b"ACK:%d" % i)
    assert wait_notifs(p, 5) == [("decode", b"ACK:%d" % i) for i in range(5)]


# -- (c) the target dies --------------------------------------------------------------


def expect_failure_soon(fn: Callable[[], object], what: str) -> tuple[TransportError, float]:
    """Call ``fn`` until it raises a TransportError; fail if it never does in time."""
    start = time.monotonic()
    while time.monotonic() - start < FAIL_DETECT_S:
        try:
            fn()
        except TransportError as exc:
            return exc, time.monotonic() - start
    raise AssertionError(f"{what}: no TransportError within {FAIL_DETECT_S}s")


def test_target_killed_before_write(
    local_transport: Callable[..., Transport], peers: Callable[..., PeerProcess]
) -> None:
    d = peers("decode", nbytes=8 * PIECE)
    p, src = source(local_transport, 8 * PIECE)
    p.connect("decode", "127.0.0.1", d.port, timeout_s=CONNECT_S)
    wait_write(p, p.write("decode", pieces(src.ctypes.data, [0]), pieces(d.addr, [0]), b"w"))
    d.kill()

    def write_and_wait() -> None:
        h = p.write("decode", pieces(src.ctypes.data, [1, 2]), pieces(d.addr, [5, 3]), b"x")
        try:
            wait_write(p, h, FAIL_DETECT_S)
        finally:
            p.release(h)

    exc, took = expect_failure_soon(write_and_wait, "write to a killed peer")
    assert isinstance(exc, PeerDisconnected), repr(exc)
    assert isinstance(exc.__cause__, Exception) and "nixl" in type(exc.__cause__).__name__
    print(f"write to killed peer failed after {took * 1e3:.1f} ms: {exc}")
    exc, took = expect_failure_soon(lambda: p.send_notif("decode", b"hello?"), "send_notif")
    assert isinstance(exc, PeerDisconnected), repr(exc)


def test_target_killed_during_write(
    local_transport: Callable[..., Transport], peers: Callable[..., PeerProcess]
) -> None:
    n = 8192  # 128 MiB in 16 KiB pieces, reversed so NIXL cannot merge them
    d = peers("decode", nbytes=n * PIECE)
    p, src = source(local_transport, n * PIECE)
    p.connect("decode", "127.0.0.1", d.port, timeout_s=CONNECT_S)
    src_rows = pieces(src.ctypes.data, list(range(n)))
    dst_rows = pieces(d.addr, list(range(n))[::-1])
    d.call("die_in", 0.005)  # the child SIGKILLs itself 5 ms from now
    start = time.monotonic()
    outcome, phase = "DONE", "write"
    try:
        # Over CMA the bytes move inside transfer() itself, so the kill lands either in
        # write() or in a later poll; either must raise, or the data got there first.
        h = p.write("decode", src_rows, dst_rows, b"big")
        posted_ms = (time.monotonic() - start) * 1e3
        phase = f"poll (write returned done={h.done} after {posted_ms:.1f} ms)"
        try:
            wait_write(p, h, FAIL_DETECT_S)
        finally:
            p.release(h)
    except TransportError as exc:
        outcome = type(exc).__name__
    took = time.monotonic() - start
    print(f"in-flight WRITE outcome {outcome} in {phase}, after {took * 1e3:.1f} ms")
    assert took < FAIL_DETECT_S
    d.proc.join(FAIL_DETECT_S)
    assert d.proc.exitcode == -9, d.proc.exitcode

    def small_write() -> None:
        h2 = p.write("decode", pieces(src.ctypes.data, [0]), pieces(d.addr, [0]), b"x")
        try:
            wait_write(p, h2, FAIL_DETECT_S)
        finally:
            p.release(h2)

    exc, _ = expect_failure_soon(small_write, "write after the kill")
    assert isinstance(exc, TransportError)
    expect_failure_soon(lambda: p.send_notif("decode", b"x"), "send_notif after the kill")


def test_restarted_target_needs_remove_then_reconnect(
    local_transport: Callable[..., Transport], peers: Callable[..., PeerProcess]
) -> None:
    d = peers("decode", nbytes=4 * PIECE)
    p, src = source(local_transport, 4 * PIECE)
    p.connect("decode", "127.0.0.1", d.port, timeout_s=CONNECT_S)
    port = d.port
    d.kill()
    d2 = peers("decode", port=port, nbytes=4 * PIECE)  # same name, same port, new process
    exc, _ = expect_failure_soon(
        lambda: wait_write(
            p, p.write("decode", pieces(src.ctypes.data, [0]), pieces(d2.addr, [0]), b"x")
        ),
        "stale metadata",
    )
    assert isinstance(exc, TransportError)
    p.remove_peer("decode")
    p.connect("decode", "127.0.0.1", port, timeout_s=CONNECT_S)
    h = p.write("decode", pieces(src.ctypes.data, [2]), pieces(d2.addr, [1]), b"again")
    wait_write(p, h)
    p.release(h)
    assert d2.call("wait_notifs", 1, 10.0) == [("prefill", b"again")]
    got = np.frombuffer(d2.call("read", PIECE, PIECE), dtype=np.uint8)
    assert np.array_equal(got, src[2 * PIECE : 3 * PIECE])


# -- (d) nobody listens ----------------------------------------------------------------


def test_connect_to_a_dead_port_is_unreachable(local_transport: Callable[..., Transport]) -> None:
    p = local_transport("prefill")
    start = time.monotonic()
    with pytest.raises(PeerUnreachable, match="decode"):
        p.connect("decode", "127.0.0.1", free_port(), timeout_s=1.0)
    took = time.monotonic() - start
    # The 1 s timeout is honoured: not before it, and not long after (5 s covers a loaded box;
    # a dial that ignored its timeout would wait for the kernel's, minutes).
    assert 1.0 <= took < 6.0, took
    with pytest.raises(PeerUnknown):
        p.send_notif("decode", b"x")


# -- (e) the listener comes up late ----------------------------------------------------


def test_connect_retries_until_a_late_listener(
    local_transport: Callable[..., Transport], peers: Callable[..., PeerProcess]
) -> None:
    p = local_transport("prefill")
    port = free_port()
    result: dict[str, object] = {}

    def dial() -> None:
        try:
            p.connect("decode", "127.0.0.1", port, timeout_s=CONNECT_S + 30)
            result["ok"] = time.monotonic()
        except TransportError as exc:
            result["err"] = exc

    started = time.monotonic()
    th = threading.Thread(target=dial, name="dial", daemon=True)
    th.start()
    while time.monotonic() - started < 1.0:  # a deliberate head start, not a sync
        assert th.is_alive(), result
        time.sleep(0.05)
    peers("decode", port=port, wait=False)
    th.join(CONNECT_S + 40)
    assert not th.is_alive(), "connect did not return"
    assert "ok" in result, result
    assert result["ok"] - started >= 1.0  # type: ignore[operator]
    assert p.peer_ready("decode")


def test_poll_peer_loop_with_a_late_listener(
    local_transport: Callable[..., Transport], peers: Callable[..., PeerProcess]
) -> None:
    p, src = source(local_transport, PIECE)
    port = free_port()
    p.request_peer("decode", "127.0.0.1", port, retry_interval_s=0.05)
    started = time.monotonic()
    d: PeerProcess | None = None
    while not p.poll_peer("decode", time.monotonic()):
        now = time.monotonic()
        if d is None and now - started >= 1.0:
            d = peers("decode", port=port, wait=False)
        assert now - started < CONNECT_S + 30, "peer never became ready"
        time.sleep(0.002)
    assert d is not None
    d.wait_ready()
    h = p.write("decode", pieces(src.ctypes.data, [0]), pieces(d.addr, [0]), b"late")
    wait_write(p, h)
    assert d.call("wait_notifs", 1, 10.0) == [("prefill", b"late")]


def test_close_is_idempotent_and_later_calls_raise(
    local_transport: Callable[..., Transport],
) -> None:
    p = local_transport("prefill")
    p.close()
    p.close()
    with pytest.raises(TransportError, match="closed"):
        p.get_notifs()


def test_peer_error_surface_from_child(peers: Callable[..., PeerProcess]) -> None:
    d = peers("decode")
    with pytest.raises(PeerError) as info:  # the child's transport raises ours, too
        d.call("send_notif", "nobody", b"x")
    assert info.value.kind == "PeerUnknown"
