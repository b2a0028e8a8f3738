"""connector.transport.ports.free_port: outside the ephemeral range, free for TCP and UDP,
never twice."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from connector.transport import ports


class _Scripted:
    """Stands in for the SystemRandom: hands out the given ports in order."""

    def __init__(self, picks: list[int]) -> None:
        self.picks = picks

    def randrange(self, lo: int, hi: int) -> int:
        port = self.picks.pop(0)
        assert lo <= port < hi
        return port


@pytest.fixture
def udp_holder() -> Iterator[socket.socket]:
    """A UDP socket on a port below the ephemeral range (TCP on it stays free)."""
    lo, _ = ports.ephemeral_range()
    for port in range(lo - 1, ports.FLOOR, -7):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        yield s
        s.close()
        return
    pytest.skip("no free UDP port below the ephemeral range")


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    lo, _ = ports.ephemeral_range()
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == 50
    assert all(ports.FLOOR <= p < lo for p in got), got
    for p in got[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", p))


def test_a_port_taken_for_udp_only_is_skipped(
    monkeypatch: pytest.MonkeyPatch, udp_holder: socket.socket
) -> None:
    taken = udp_holder.getsockname()[1]
    other = ports.free_port()  # free now; handed out, so the script must not repeat it
    monkeypatch.setattr(ports, "_handed", set())
    monkeypatch.setattr(ports, "_rng", _Scripted([taken, other]))
    assert ports.free_port() == other


def test_a_port_handed_out_before_is_not_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = ports.free_port(), ports.free_port()  # both free now
    monkeypatch.setattr(ports, "_handed", {first})
    monkeypatch.setattr(ports, "_rng", _Scripted([first, second]))
    assert ports.free_port() == second


def test_falls_back_to_the_kernel_when_no_room_below_the_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.FLOOR + 10, 60999))
    monkeypatch.setattr(ports, "_rng", _Scripted([]))  # any draw would fail the test
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
