"""``pushkv collect``: a small OTLP/HTTP trace receiver that writes OTLP JSON lines.

Owns: the ASGI app (``POST /v1/traces`` in OTLP's protobuf or JSON encoding, gzip or not;
``GET /health``) and ``main``. Each accepted export becomes one line of the same format the
processes' own JSON-lines exporter writes (``telemetry.exporters``), in
``<run dir>/traces-collector-<pid>.jsonl``, so the dashboard reads a collector's folder like
any run folder. For hosts that cannot share a folder and have no Jaeger: point every
process's ``OTEL_EXPORTER_OTLP_ENDPOINT`` here. Binds 127.0.0.1 unless told otherwise.

Decoding uses the official OTLP protobuf types (``opentelemetry-proto``); a body that does
not parse is a 400 and writes nothing.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from telemetry.exporters import hex_ids

logger = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"


class TraceSink:
    """Appends OTLP/JSON ``TracesData`` lines to one file; counts what it took."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self.exports = self.spans = self.rejected = 0

    def write(self, traces: dict[str, Any]) -> int:
        n = sum(
            len(ss.get("spans", ()))
            for rs in traces.get("resourceSpans", ())
            for ss in rs.get("scopeSpans", ())
        )
        line = (
            json.dumps({"resourceSpans": traces.get("resourceSpans", [])}, separators=(",", ":"))
            + "\n"
        )
        with self._lock:
            self._file.write(line)
            self._file.flush()
            self.exports += 1
            self.spans += n
        return n

    def close(self) -> None:
        with self._lock:
            self._file.close()


def decode_export(body: bytes, content_type: str, encoding: str) -> dict[str, Any]:
    """An OTLP ``ExportTraceServiceRequest`` as OTLP/JSON (hex ids); ValueError if bad."""
    if encoding == "gzip":
        try:
            body = gzip.decompress(body)
        except OSError as exc:
            raise ValueError(f"bad gzip body: {exc}") from None
    if content_type.startswith(PROTOBUF):
        from google.protobuf.json_format import MessageToDict
        from google.protobuf.message import DecodeError
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        msg = ExportTraceServiceRequest()
        try:
            msg.ParseFromString(body)
        except DecodeError as exc:
            raise ValueError(f"not an OTLP protobuf export: {exc}") from None
        return hex_ids(MessageToDict(msg, use_integers_for_enums=True))
    if content_type.startswith(JSON):
        try:
            data = json.loads(body)
        except ValueError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("resourceSpans", []), list):
            raise ValueError("an OTLP/JSON export is an object with a resourceSpans list")
        return data
    raise ValueError(f"unsupported content type {content_type!r} (want {PROTOBUF} or {JSON})")


def create_app(sink: TraceSink) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def traces(request: Request) -> Response:
        ctype = request.headers.get("content-type", "")
        try:
            data = decode_export(
                await request.body(), ctype, request.headers.get("content-encoding", "")
            )
        except ValueError as exc:
            sink.rejected += 1
            return JSONResponse({"code": 3, "message": str(exc)}, status_code=400)
        sink.write(data)
        if ctype.startswith(PROTOBUF):
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                ExportTraceServiceResponse,
            )

            return Response(ExportTraceServiceResponse().SerializeToString(), media_type=PROTOBUF)
        return JSONResponse({})

    async def health(_request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "file": str(sink.path),
                "exports": sink.exports,
                "spans": sink.spans,
                "rejected": sink.rejected,
            }
        )

    return Starlette(
        routes=[
            Route("/v1/traces", traces, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ]
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pushkv collect", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument(
        "--run-dir",
        default=os.environ.get("PUSHKV_RUN_DIR", "runs/latest"),
        help="where traces-collector-<pid>.jsonl goes (default: $PUSHKV_RUN_DIR or runs/latest)",
    )
    args = parser.parse_args(argv)
    import uvicorn

    sink = TraceSink(Path(args.run_dir) / f"traces-collector-{os.getpid()}.jsonl")
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info(
        "OTLP/HTTP receiver on http://%s:%d/v1/traces -> %s", args.host, args.port, sink.path
    )
    try:
        uvicorn.run(
            create_app(sink), host=args.host, port=args.port, access_log=False, log_level="warning"
        )
    finally:
        sink.close()
    return 0
