"""The push over real NIXL between real processes with the P/D plane's shared secret
(docs/security.md): with matching secrets the bytes land as without one; with a mismatch
(another secret, or none on one side) the transfer fails definitely on both sides,
nothing lands, nothing crashes, and the counters show what was dropped."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from test_push_loopback import (
    check_bytes,
    cluster,  # noqa: F401 (a fixture: `ranks` below uses it)
    run_transfer,
)

from connector.core import events as ev
from connector.core.messages import FailReason
from connector.core.state import SenderPolicy
from connector.tools.loopback import RankProcess, expected_event

pytestmark = [pytest.mark.nixl]

KEY = b"pushkv-test-secret-0123456789"
OTHER = b"another-secret-9876543210xyz"
MS = 1_000_000
BLOCKS = dict(p_blocks=(1, 2, 3, 9), d_blocks=(7, 3, 12, 5), num_tokens=60)


@pytest.fixture
def ranks(request: pytest.FixtureRequest) -> Callable[..., RankProcess]:
    """test_push_loopback's ``cluster``: ranks started here are stopped by PID at teardown."""
    return request.getfixturevalue("cluster")  # type: ignore[no-any-return]


def auth_drops(counters: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in counters.items() if "auth" in k and v}


def test_matching_secrets_push_the_same_bytes(ranks: Callable[..., RankProcess]) -> None:
    p, d = ranks("P", "prefill", secret=KEY), ranks("D", "decode", secret=KEY)
    run_transfer([p], [d], tid="s-1", **BLOCKS)
    check_bytes([p], [d], **BLOCKS)
    for rank in (p, d):
        c = rank.counters()
        assert auth_drops({**c.thread, **c.transport}) == {}, rank.spec.agent
        assert c.thread.get("malformed_notifs", 0) == 0


@pytest.mark.parametrize(
    "p_secret, d_secret, p_drop",
    [
        (KEY, OTHER, "side_dropped_auth_bad_tag"),
        (KEY, None, "side_dropped_auth_missing"),
        (None, KEY, "side_dropped_auth_unexpected"),
    ],
    ids=["other-secret", "d-without", "p-without"],
)
def test_mismatched_secrets_fail_definitely(
    ranks: Callable[..., RankProcess],
    p_secret: bytes | None,
    d_secret: bytes | None,
    p_drop: str,
) -> None:
    p = ranks("P", "prefill", secret=p_secret, send_policy=SenderPolicy(lease_ns=1_500 * MS))
    d = ranks("D", "decode", secret=d_secret, dial_timeout_s=1.0)
    tid, nt = "s-bad", BLOCKS["num_tokens"]
    d.submit(expected_event(tid, [p.spec], d.spec, BLOCKS["d_blocks"], nt))  # type: ignore[arg-type]
    p.submit(ev.PrefillDone(tid, f"preq-{tid}", (BLOCKS["p_blocks"],), nt))  # type: ignore[arg-type]
    # D: its registration never got through (P refused D's metadata request): failed.
    d.wait("the failed receive", lambda r: any(x.transfer_id == tid for x in r.received), 20)
    (got,) = d.received
    assert not got.ok and got.reason is FailReason.HANDSHAKE
    # P: no registration ever came; the lease frees the blocks.
    p.wait("P's blocks freed", lambda r: f"preq-{tid}" in r.sent, 20)
    pc = p.counters()
    assert pc.transport.get(p_drop, 0) >= 1, pc.transport
    assert pc.endpoint.get("sender_mismatch", 0) == 0
    assert not np.any(d.read())  # not a byte landed
    # Both still serve: each answers a command and holds no transfer in flight.
    assert p.proc.is_alive() and d.proc.is_alive()
    assert pc.thread.get("loop_errors", 0) == 0 and d.counters().thread.get("loop_errors", 0) == 0
