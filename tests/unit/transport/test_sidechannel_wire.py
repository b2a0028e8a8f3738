"""The side channel's wire frame, sans IO: encode_frame and FrameReader (no sockets, no NIXL).

Owns: round trips under any chunking, and every refusal (each with its counter key).
Must not import: nixl, socket servers (the threads and sockets are integration tests).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.core.errors import LocalProtocolError, RemoteProtocolError
from connector.transport.sidechannel_wire import (
    HEADER,
    KIND_EXCHANGE,
    KIND_REPLY,
    MAGIC,
    MAX_NAME_BYTES,
    VERSION,
    Frame,
    FrameReader,
    drop_reason,
    encode_frame,
)

CAP = 1 << 16  # a small cap keeps the oversized cases cheap


def feed_all(data: bytes, chunks: list[int] | None = None, cap: int = CAP) -> Frame | None:
    """Feed ``data`` in pieces (sizes from ``chunks``, then the rest); the last result."""
    reader, got, pos = FrameReader(cap), None, 0
    for size in chunks or []:
        if pos >= len(data):
            break
        got = reader.feed(data[pos : pos + size])
        pos += size
        if got is not None:
            assert pos >= len(data), "a frame came out before all of it was fed"
    if pos < len(data):
        got = reader.feed(data[pos:])
    return got


def refusal(data: bytes, cap: int = CAP) -> str:
    with pytest.raises(RemoteProtocolError) as info:
        feed_all(data, cap=cap)
    return drop_reason(info.value)


def header(
    magic: bytes = MAGIC,
    version: int = VERSION,
    kind: int = KIND_EXCHANGE,
    name_len: int = 1,
    md_len: int = 0,
) -> bytes:
    return HEADER.pack(magic, version, kind, name_len, md_len)


@given(
    name=st.text(min_size=1, max_size=40).filter(lambda n: len(n.encode()) <= MAX_NAME_BYTES),
    metadata=st.binary(max_size=2048),
    kind=st.sampled_from([KIND_EXCHANGE, KIND_REPLY]),
    chunks=st.lists(st.integers(1, 64), max_size=40),
)
def test_round_trip_under_any_chunking(
    name: str, metadata: bytes, kind: int, chunks: list[int]
) -> None:
    data = encode_frame(kind, name, metadata, CAP)
    assert feed_all(data, chunks) == Frame(kind, name, metadata)


def test_wanted_counts_down_from_header_to_body() -> None:
    data = encode_frame(KIND_REPLY, "decode", b"x" * 10)
    reader = FrameReader()
    assert reader.wanted == HEADER.size
    assert reader.feed(data[:5]) is None and reader.wanted == HEADER.size - 5
    assert reader.feed(data[5 : HEADER.size]) is None and reader.wanted == len("decode") + 10
    assert reader.feed(data[HEADER.size : -1]) is None and reader.wanted == 1
    assert reader.feed(data[-1:]) == Frame(KIND_REPLY, "decode", b"x" * 10)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (header(magic=b"HTTP"), "bad_magic"),
        (b"GET / HTTP/1.1\r\n\r\n", "bad_magic"),
        (header(version=0), "bad_version"),
        (header(version=VERSION + 1), "bad_version"),
        (header(kind=0), "bad_kind"),
        (header(kind=9), "bad_kind"),
        (header(md_len=CAP + 1), "oversized"),
        (header(md_len=0xFFFFFFFF), "oversized"),
        (header(name_len=MAX_NAME_BYTES + 1), "oversized"),
        (header(name_len=0), "malformed"),
        (header(name_len=2) + b"\xff\xfe", "malformed"),  # not UTF-8
        (encode_frame(KIND_EXCHANGE, "p", b"md") + b"trailing", "malformed"),
    ],
)
def test_refusals_carry_their_counter_key(data: bytes, reason: str) -> None:
    assert refusal(data) == reason


def test_oversized_is_refused_on_the_header_alone() -> None:
    # The body of a 4 GiB claim is never waited for (nor buffered).
    reader = FrameReader(CAP)
    with pytest.raises(RemoteProtocolError) as info:
        reader.feed(header(md_len=CAP + 1))
    assert drop_reason(info.value) == "oversized"


def test_the_cap_is_inclusive() -> None:
    data = encode_frame(KIND_REPLY, "d", b"\0" * CAP, CAP)
    assert feed_all(data, cap=CAP) == Frame(KIND_REPLY, "d", b"\0" * CAP)


@given(st.binary(max_size=256))
def test_arbitrary_bytes_never_raise_anything_else(data: bytes) -> None:
    reader = FrameReader(CAP)
    try:
        reader.feed(data)
    except RemoteProtocolError as exc:
        assert drop_reason(exc) in {
            "bad_magic",
            "bad_version",
            "bad_kind",
            "oversized",
            "malformed",
        }


@pytest.mark.parametrize(
    ("kind", "name", "metadata"),
    [
        (KIND_EXCHANGE, "", b""),  # no name
        (KIND_EXCHANGE, "n" * (MAX_NAME_BYTES + 1), b""),
        (7, "p", b""),
        (KIND_REPLY, "p", b"\0" * (CAP + 1)),
    ],
)
def test_encoding_a_bad_frame_is_our_bug(kind: int, name: str, metadata: bytes) -> None:
    with pytest.raises(LocalProtocolError):
        encode_frame(kind, name, metadata, CAP)


def test_module_imports_no_nixl() -> None:
    code = (
        "import sys, connector.transport.sidechannel;"
        "bad=[m for m in sys.modules if m.split('.')[0] in "
        "('nixl','nixl_cu12','nixl_cu13','torch','numpy')]; assert not bad, bad"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=root)
