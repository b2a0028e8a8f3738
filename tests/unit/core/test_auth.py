"""The P/D plane's authentication (connector/core/auth.py): sealed frames, the replay
window, signed tokens, and sealed protocol messages (messages.encode/decode with a key)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core import auth
from connector.core import messages as m
from connector.core.errors import RemoteProtocolError
from tests.unit.core.test_messages import SAMPLES

KEY = b"k" * 32
OTHER = b"o" * 32
NOW = 1_700_000_000_000
WINDOW = 120_000


def stamp(ts: int = NOW, n: int = 0) -> auth.Stamp:
    return auth.Stamp(ts, n.to_bytes(auth.NONCE_BYTES, "big"))


def reason(exc: pytest.ExceptionInfo[auth.AuthError]) -> str:
    return exc.value.reason


# -- seal / unseal -----------------------------------------------------------------------


def test_seal_round_trip_and_binds_aad() -> None:
    frame = auth.seal(KEY, auth.NOTIF, b"body", stamp(), aad=b"agent-a")
    assert auth.is_sealed(frame) and len(frame) == auth.OVERHEAD + 4
    body, st_ = auth.unseal(KEY, auth.NOTIF, frame, NOW, WINDOW, aad=b"agent-a")
    assert body == b"body" and st_ == stamp()
    with pytest.raises(auth.AuthError) as e:
        auth.unseal(KEY, auth.NOTIF, frame, NOW, WINDOW, aad=b"agent-b")
    assert reason(e) == "bad_tag"


@pytest.mark.parametrize(
    "key, domain, want",
    [(OTHER, auth.NOTIF, "bad_tag"), (KEY, auth.BELL, "bad_tag"), (KEY, auth.NOTIF, None)],
)
def test_wrong_key_or_domain(key: bytes, domain: bytes, want: str | None) -> None:
    frame = auth.seal(KEY, auth.NOTIF, b"x", stamp())
    if want is None:
        assert auth.unseal(key, domain, frame, NOW, WINDOW)[0] == b"x"
        return
    with pytest.raises(auth.AuthError) as e:
        auth.unseal(key, domain, frame, NOW, WINDOW)
    assert reason(e) == want


@given(st.binary(min_size=0, max_size=64), st.data())
def test_any_single_byte_change_is_refused(body: bytes, data: st.DataObject) -> None:
    frame = bytearray(auth.seal(KEY, auth.NOTIF, body, stamp()))
    i = data.draw(st.integers(0, len(frame) - 1))
    frame[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(auth.AuthError) as e:
        auth.unseal(KEY, auth.NOTIF, bytes(frame), NOW, WINDOW)
    # The magic changed: "missing"; a stamp byte moving it out of the window is still a
    # bad tag, since the tag is checked first.
    assert reason(e) in {"missing", "bad_tag"}


@given(st.binary(max_size=200))
def test_arbitrary_bytes_refused_cleanly(data: bytes) -> None:
    with pytest.raises(auth.AuthError):
        auth.unseal(KEY, auth.NOTIF, data, NOW, WINDOW)
    with pytest.raises(auth.AuthError):
        auth.unseal(KEY, auth.NOTIF, auth.SEAL_MAGIC + data, NOW, WINDOW)


@pytest.mark.parametrize(
    "ts, want",
    [
        (NOW - WINDOW - 1, "stale"),
        (NOW + WINDOW + 1, "future"),
        (NOW - WINDOW, None),
        (NOW + WINDOW, None),
    ],
)
def test_window_edges(ts: int, want: str | None) -> None:
    frame = auth.seal(KEY, auth.NOTIF, b"x", stamp(ts))
    if want is None:
        auth.unseal(KEY, auth.NOTIF, frame, NOW, WINDOW)
        return
    with pytest.raises(auth.AuthError) as e:
        auth.unseal(KEY, auth.NOTIF, frame, NOW, WINDOW)
    assert reason(e) == want


def test_truncated_and_bad_nonce() -> None:
    with pytest.raises(auth.AuthError) as e:
        auth.unseal(KEY, auth.NOTIF, auth.SEAL_MAGIC + b"\0" * 10, NOW, WINDOW)
    assert reason(e) == "malformed"
    with pytest.raises(ValueError):
        auth.seal(KEY, auth.NOTIF, b"x", auth.Stamp(NOW, b"short"))
    with pytest.raises(ValueError):
        auth.check_key(b"short")


def test_unseal_with_replay_window_refuses_the_second_copy() -> None:
    replay = auth.ReplayWindow(WINDOW)
    frame = auth.seal(KEY, auth.NOTIF, b"x", stamp())
    auth.unseal(KEY, auth.NOTIF, frame, NOW, WINDOW, replay=replay)
    with pytest.raises(auth.AuthError) as e:
        auth.unseal(KEY, auth.NOTIF, frame, NOW + 5, WINDOW, replay=replay)
    assert reason(e) == "replayed"


def test_forged_frames_never_enter_the_replay_window() -> None:
    replay = auth.ReplayWindow(WINDOW)
    forged = auth.seal(OTHER, auth.NOTIF, b"x", stamp())
    with pytest.raises(auth.AuthError):
        auth.unseal(KEY, auth.NOTIF, forged, NOW, WINDOW, replay=replay)
    assert len(replay) == 0
    auth.unseal(
        KEY, auth.NOTIF, auth.seal(KEY, auth.NOTIF, b"x", stamp()), NOW, WINDOW, replay=replay
    )


# -- the replay window -------------------------------------------------------------------


def test_window_forgets_expired_stamps_and_caps_with_a_floor() -> None:
    w = auth.ReplayWindow(100, max_entries=3)
    for i in range(3):
        w.accept(stamp(1000 + i, i), 1000)
    assert len(w) == 3
    w.accept(stamp(1003, 3), 1003)  # full: the oldest (1000) is forgotten, floor 1000
    assert w.floor_ms == 1000 and len(w) == 3
    with pytest.raises(auth.AuthError) as e:
        w.accept(stamp(1000, 0), 1003)  # it would be new to the set, but is at the floor
    assert reason(e) == "stale"
    w.accept(stamp(1200, 9), 1200)  # everything before 1100 has expired
    assert len(w) == 1


@settings(max_examples=300)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(-70, 70), st.integers(0, 5)), max_size=120),
    st.integers(1, 12),
)
def test_replay_window_accepts_each_fresh_stamp_exactly_once(
    ops: list[tuple[int, int, int]], cap: int
) -> None:
    """Whatever the order, clock and capacity: no stamp is accepted twice, none outside
    the window, and a refusal of a fresh, new stamp is explained by the floor only."""
    window = 50
    w = auth.ReplayWindow(window, max_entries=cap)
    now, accepted = 10_000, set()
    for advance, offset, nonce in ops:
        now += advance
        s = stamp(now + offset, nonce)
        try:
            w.accept(s, now)
        except auth.AuthError as exc:
            if exc.reason == "replayed":
                assert s in accepted
            elif exc.reason == "future":
                assert offset > window
            else:
                assert exc.reason == "stale"
                assert offset < -window or s.ts_ms <= w.floor_ms
            continue
        assert s not in accepted and abs(offset) <= window
        assert len(w) <= cap
        accepted.add(s)


def test_window_rejects_nonsense_sizes() -> None:
    with pytest.raises(ValueError):
        auth.ReplayWindow(0)
    with pytest.raises(ValueError):
        auth.ReplayWindow(10, max_entries=0)


# -- tokens ------------------------------------------------------------------------------


def test_token_round_trip_expiry_and_binding() -> None:
    tok = auth.sign_token(KEY, auth.COORDS, b"payload", NOW + 1000)
    auth.verify_token(KEY, auth.COORDS, b"payload", tok, NOW + 1000)
    cases = [
        (KEY, auth.COORDS, b"payload", NOW + 1001, "expired"),
        (OTHER, auth.COORDS, b"payload", NOW, "bad_tag"),
        (KEY, auth.NOTIF, b"payload", NOW, "bad_tag"),
        (KEY, auth.COORDS, b"payloaD", NOW, "bad_tag"),
    ]
    for key, domain, payload, now, want in cases:
        with pytest.raises(auth.AuthError) as e:
            auth.verify_token(key, domain, payload, tok, now)
        assert reason(e) == want
    # A later expiry written into the token breaks its tag.
    _, expires, tag = tok.split(".")
    with pytest.raises(auth.AuthError) as e:
        auth.verify_token(KEY, auth.COORDS, b"payload", f"v1.{int(expires) + 10**6}.{tag}", NOW)
    assert reason(e) == "bad_tag"


@given(st.text(max_size=80))
def test_any_token_string_is_refused_cleanly(token: str) -> None:
    with pytest.raises(auth.AuthError) as e:
        auth.verify_token(KEY, auth.COORDS, b"p", token, NOW)
    assert reason(e) in {"missing", "malformed", "bad_tag", "expired"}


# -- sealed protocol messages ------------------------------------------------------------


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda x: type(x).__name__)
def test_sealed_message_round_trip(msg: m.Message) -> None:
    frame = m.encode(msg, KEY, stamp())
    assert m.is_frame(frame) and auth.is_sealed(frame)
    replay = auth.ReplayWindow(WINDOW)
    assert m.decode(frame, KEY, now_ms=NOW, replay=replay) == msg
    with pytest.raises(auth.AuthError) as e:
        m.decode(frame, KEY, now_ms=NOW, replay=replay)
    assert reason(e) == "replayed"


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda x: type(x).__name__)
def test_mismatched_secrets_are_refused(msg: m.Message) -> None:
    replay = auth.ReplayWindow(WINDOW)
    cases = [
        (m.encode(msg), KEY, "missing"),  # a peer without the secret
        (m.encode(msg, OTHER, stamp()), KEY, "bad_tag"),  # another secret
        (m.encode(msg, KEY, stamp()), None, "unexpected"),  # we have none, the peer has one
    ]
    for frame, key, want in cases:
        with pytest.raises(auth.AuthError) as e:
            m.decode(frame, key, now_ms=NOW, replay=replay)
        assert reason(e) == want
    assert len(replay) == 0


def test_sealing_needs_a_stamp_and_opening_a_window() -> None:
    with pytest.raises(ValueError):
        m.encode(SAMPLES[0], KEY)
    with pytest.raises(ValueError):
        m.decode(m.encode(SAMPLES[0], KEY, stamp()), KEY, now_ms=NOW)


@given(st.sampled_from(SAMPLES), st.data())
def test_corrupted_sealed_frames_raise_only_protocol_errors(
    msg: m.Message, data: st.DataObject
) -> None:
    frame = bytearray(m.encode(msg, KEY, stamp()))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    try:
        got = m.decode(bytes(frame[:cut]), KEY, now_ms=NOW, replay=auth.ReplayWindow(WINDOW))
    except RemoteProtocolError:
        return
    assert got == msg  # only an untouched frame gets through
