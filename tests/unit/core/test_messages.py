"""The wire codec: round trips, and strict rejection of everything else."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core import messages as m
from connector.core.errors import RemoteProtocolError
from tests.unit.core.factories import d_addr, register

SAMPLES: list[m.Message] = [
    register(),
    m.Register(
        transfer_id="x.1:a@b-c",
        d_engine_id="d",
        d_rank=3,
        d_tp_size=4,
        d_addr=d_addr(3),
        layout=register().layout,
        block_ids=((1, 2), (7,)),
        first_token=32,
        num_tokens=40,
        ttl_ms=5,
        trace=m.TraceContext(traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01"),
    ),
    msgspec.structs.replace(register(), p_pp_size=4),
    m.Completion(transfer_id="t0", p_rank=1, p_tp_size=2, bytes_total=1 << 30, descriptors=12),
    m.Completion(
        transfer_id="t0",
        p_rank=5,
        p_tp_size=2,
        digest=m.KvDigest(algo="crc32", value=7, nbytes=64, heads=(0, 1), layers=(3, 5)),
    ),
    m.Fail(transfer_id="t0", p_rank=0, reason=m.FailReason.LEASE_EXPIRED, detail="late"),
    m.Cancel(transfer_id="t0", d_rank=0, d_addr=d_addr(), reason=m.FailReason.ABORTED),
    m.Heartbeat(transfer_id="t0", d_rank=0, d_addr=d_addr(), more_ids=("t1", "t2")),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg: m.Message) -> None:
    frame = m.encode(msg)
    assert m.is_frame(frame)
    assert m.decode(frame) == msg


def test_frames_without_pipeline_stages_are_what_an_older_peer_reads() -> None:
    """``p_pp_size`` and a digest's ``layers`` travel only where P runs stages: an older P
    (or D), which refuses unknown fields, reads every frame sent without them."""
    digest = m.KvDigest(algo="crc32", value=7, nbytes=64, heads=(0, 1))
    frames = [
        m.encode(register()),
        m.encode(m.Completion(transfer_id="t0", p_rank=0, p_tp_size=1, digest=digest)),
    ]
    assert not any(b"p_pp_size" in f or b"layers" in f for f in frames)
    assert m.decode(frames[0]).p_stages == 1  # type: ignore[union-attr]
    staged = m.encode(msgspec.structs.replace(register(), p_pp_size=2))
    assert b"p_pp_size" in staged and m.decode(staged).p_stages == 2  # type: ignore[union-attr]


def test_heartbeat_lists_every_id() -> None:
    hb = m.Heartbeat(transfer_id="a", d_rank=0, d_addr=d_addr(), more_ids=("b",))
    assert hb.transfer_ids() == ("a", "b")


def _raw(obj: object) -> bytes:
    return m.MAGIC + msgspec.msgpack.encode(obj)


def _as_dict(msg: m.Message) -> dict:
    return msgspec.to_builtins(msg)


@pytest.mark.parametrize(
    "frame, match",
    [
        (b"", "bad magic"),
        (b"PUSH_REG:" + b"x" * 10, "bad magic"),
        (m.MAGIC + b"\xc1", "malformed frame header"),
        (
            _raw({"version": 2, "type": "done", "transfer_id": "t", "p_rank": 0, "p_tp_size": 1}),
            "unknown protocol version 2",
        ),
        (_raw({"version": 1, "type": "nope", "transfer_id": "t"}), "malformed 'nope'"),
        (
            _raw({"version": 1, "type": "done", "transfer_id": "t", "p_rank": -1, "p_tp_size": 1}),
            "malformed 'done'",
        ),
        (
            _raw(
                {
                    "version": 1,
                    "type": "done",
                    "transfer_id": "t",
                    "p_rank": 0,
                    "p_tp_size": 1,
                    "extra": 1,
                }
            ),
            "malformed 'done'",
        ),
        (
            _raw({"version": 1, "type": "done", "transfer_id": "", "p_rank": 0, "p_tp_size": 1}),
            "malformed 'done'",
        ),
        (
            _raw({"version": 1, "type": "done", "transfer_id": "a b", "p_rank": 0, "p_tp_size": 1}),
            "malformed 'done'",
        ),
        (
            _raw(
                {
                    "version": 1,
                    "type": "done",
                    "transfer_id": "t" * 129,
                    "p_rank": 0,
                    "p_tp_size": 1,
                }
            ),
            "malformed 'done'",
        ),
        (
            _raw(
                {"version": 1, "type": "fail", "transfer_id": "t", "p_rank": 0, "reason": "bogus"}
            ),
            "malformed 'fail'",
        ),
        (_raw({"version": 1, "type": "done", "p_rank": 0, "p_tp_size": 1}), "malformed 'done'"),
        (_raw({**_as_dict(register()), "ttl_ms": 0}), "malformed 'register'"),
        (_raw({**_as_dict(register()), "block_ids": []}), "malformed 'register'"),
        (_raw({**_as_dict(register()), "block_ids": [[-4]]}), "malformed 'register'"),
        (
            _raw({**_as_dict(register()), "d_addr": {"agent": "d", "host": "h", "port": 0}}),
            "malformed 'register'",
        ),
        (m.encode(SAMPLES[2])[:-3], "malformed"),
        (m.MAGIC + b"\x00" * (m.MAX_FRAME_BYTES), "exceeds"),
    ],
)
def test_rejects(frame: bytes, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        m.decode(frame)


def test_rejects_too_many_blocks() -> None:
    d = _as_dict(register())
    d["block_ids"] = [list(range(m.MAX_BLOCKS_PER_GROUP + 1))]
    with pytest.raises(RemoteProtocolError):
        m.decode(_raw(d))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_never_raise_anything_else(data: bytes) -> None:
    for frame in (data, m.MAGIC + data):
        try:
            m.decode(frame)
        except RemoteProtocolError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_corrupted_frames_decode_or_raise_cleanly(msg: m.Message, data: st.DataObject) -> None:
    frame = bytearray(m.encode(msg))
    i = data.draw(st.integers(len(m.MAGIC), len(frame) - 1))
    frame[i] = data.draw(st.integers(0, 255))
    try:
        out = m.decode(bytes(frame))
    except RemoteProtocolError:
        return
    assert isinstance(out, (m.Register, m.Completion, m.Fail, m.Cancel, m.Heartbeat))
