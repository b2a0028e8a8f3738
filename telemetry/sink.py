"""The JSON-lines sink: a process of its own that encodes span records and writes the file.

Owns: the child side of ``telemetry.span_pipe``. Reads frames from stdin (``B``: a marshal'd
batch of new group headers and ``SpanRecords`` rows; ``F``: flush the file, then answer one
byte on stdout) and appends one OTLP/JSON line per batch to the file named on the command
line. Exits at end of input, which comes when every holder of the pipe's write end is gone,
a SIGKILLed one included: what reached the pipe is written. SIGINT and SIGTERM are ignored
for that reason (a signal to the whole process group must not cut the drain short). It runs
niced, on any CPU: encoding never waits for the GIL of an engine loop, and gives way to it.

    python -m telemetry.sink PATH
"""

from __future__ import annotations

import marshal
import os
import signal
import struct
import sys
from pathlib import Path
from typing import BinaryIO

from telemetry.exporters import Header, encode_records

FRAME = struct.Struct("!cI")  # kind, payload length
BATCH, FLUSH = b"B", b"F"
ACK = b"\x01"


def _read(stream: BinaryIO, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def _step_aside() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        os.nice(19)
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:
        pass  # a confined container: run where allowed


def serve(path: Path, inp: BinaryIO, out: BinaryIO) -> int:
    headers: dict[int, Header] = {}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        while True:
            head = _read(inp, FRAME.size)
            if len(head) < FRAME.size:
                return 0
            kind, n = FRAME.unpack(head)
            payload = _read(inp, n)
            if len(payload) < n:
                return 0  # the writer died mid-frame: the frames before it are written
            if kind == BATCH:
                new, rows = marshal.loads(payload)
                headers.update(new)
                if rows:
                    f.write(encode_records(headers, rows))
                    f.flush()  # out at once; a live reader may still catch a line mid-write
            elif kind == FLUSH:
                f.flush()
                out.write(ACK)
                out.flush()


def main(argv: list[str]) -> int:
    _step_aside()
    return serve(Path(argv[0]), sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
