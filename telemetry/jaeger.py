"""Reading traces from Jaeger v2's HTTP query API, v3 (``/api/v3/traces``).

Owns: the HTTP calls (httpx), their parameters, paging and error messages. Responses are OTLP
JSON in a ``{"result": TracesData}`` envelope, parsed by ``telemetry.otlp_json``; several
traces come concatenated in one ``resourceSpans`` list and are grouped by trace id here.

Jaeger's search has no cursor: ``query.start_time_min``/``max`` are required and
``query.search_depth`` caps the traces of one answer, newest first. ``find_traces`` pages by
narrowing the window: when a page comes back full, the next asks for traces that started no
later than the oldest one seen (inclusive, so traces sharing that instant are not lost; the
page is made larger by the traces it will repeat, which are kept once), until a page adds
nothing or ``limit`` is reached.
Not found is HTTP 404 with ``{"error": {"httpCode": 404, "message": "No traces found"}}``:
that is an empty answer, not an error. Anything else that goes wrong raises ``JaegerError``
with the URL and what Jaeger said.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from telemetry.otlp_json import OtlpFormatError, Trace, group_traces, parse_traces_data

DEFAULT_PAGE_SIZE = 500


class JaegerError(RuntimeError):
    """Jaeger could not be asked, or answered with an error (message says which and why)."""


def rfc3339_nano(unix_ns: int) -> str:
    """Jaeger's time format: RFC 3339 with nanoseconds, UTC (``2026-11-29T10:00:00.000000000Z``)."""
    secs, frac = divmod(unix_ns, 1_000_000_000)
    return datetime.fromtimestamp(secs, UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{frac:09d}Z"


def unix_ns(t: datetime) -> int:
    """A datetime (naive means UTC) as unix nanos, without float rounding."""
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    delta = t - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000


@dataclass
class JaegerClient:
    """A v3 query client for one Jaeger (``base_url`` like ``http://127.0.0.1:16686``)."""

    base_url: str
    timeout_s: float = 10.0
    transport: httpx.BaseTransport | None = None  # tests may pass one; default: real HTTP

    def _get(self, path: str, params: dict[str, str] | None = None) -> dict[str, Any] | None:
        """GET and decode JSON; None on 404 (Jaeger's "not found")."""
        url = self.base_url.rstrip("/") + path
        try:
            with httpx.Client(timeout=self.timeout_s, transport=self.transport) as client:
                resp = client.get(url, params=params)
        except httpx.TimeoutException as e:
            raise JaegerError(
                f"Jaeger at {self.base_url} did not answer {path} within {self.timeout_s:g} s ({e})"
            ) from e
        except httpx.HTTPError as e:
            raise JaegerError(
                f"cannot reach Jaeger at {self.base_url} ({type(e).__name__}: {e}); "
                "is it running, and is this its query port (16686)?"
            ) from e
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise JaegerError(
                f"Jaeger answered {path} with HTTP {resp.status_code}: {_error_message(resp)}"
            )
        try:
            body = resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise JaegerError(f"Jaeger's answer to {path} is not JSON: {resp.text[:200]!r}") from e
        if not isinstance(body, dict):
            raise JaegerError(
                f"Jaeger's answer to {path} is not a JSON object: {resp.text[:200]!r}"
            )
        return body

    def _traces(self, body: dict[str, Any] | None, path: str) -> list[Trace]:
        if body is None:
            return []
        if "result" not in body:
            raise JaegerError(
                f"Jaeger's answer to {path} has no 'result' (is this the v3 API?): "
                f"keys {sorted(body)}"
            )
        try:
            return group_traces(parse_traces_data(body["result"] or {}))
        except OtlpFormatError as e:
            raise JaegerError(f"Jaeger's answer to {path} is not OTLP JSON: {e}") from e

    def services(self) -> list[str]:
        body = self._get("/api/v3/services") or {}
        return sorted(body.get("services") or [])

    def get_trace(self, trace_id: str) -> Trace | None:
        """One trace by hex id; None when Jaeger does not have it."""
        path = f"/api/v3/traces/{trace_id}"
        traces = self._traces(self._get(path, {"raw_traces": "true"}), path)
        return next((t for t in traces if t.trace_id == trace_id.lower()), None)

    def find_page(
        self,
        service: str,
        start_min_ns: int,
        start_max_ns: int,
        depth: int,
        operation: str | None = None,
    ) -> list[Trace]:
        """One search call: at most ``depth`` traces of ``service`` started in the window."""
        params = {
            "query.service_name": service,
            "query.start_time_min": rfc3339_nano(start_min_ns),
            "query.start_time_max": rfc3339_nano(start_max_ns),
            "query.search_depth": str(depth),
            # no clock-skew "fixing": one host clock, and P's WRITE may outlive its leg
            "query.raw_traces": "true",
        }
        if operation:
            params["query.operation_name"] = operation
        return self._traces(self._get("/api/v3/traces", params), "/api/v3/traces")

    def find_traces(
        self,
        service: str,
        start_min: datetime,
        start_max: datetime | None = None,
        limit: int = 1000,
        page_size: int = DEFAULT_PAGE_SIZE,
        operation: str | None = None,
    ) -> list[Trace]:
        """Up to ``limit`` traces of ``service`` started in [start_min, start_max], by start."""
        if limit <= 0:
            return []
        lower = unix_ns(start_min)
        upper = unix_ns(start_max or datetime.now(UTC))
        found: dict[str, Trace] = {}
        at_edge = 0  # traces already seen that start at ``upper``: the next page repeats them
        while len(found) < limit:
            depth = min(page_size, limit - len(found)) + at_edge
            page = self.find_page(service, lower, upper, depth, operation)
            new = [t for t in page if t.trace_id not in found]
            for t in new:
                found[t.trace_id] = t
            if len(page) < depth or not new:
                break
            upper = min(t.start_ns for t in page)
            at_edge = sum(1 for t in found.values() if t.start_ns == upper)
        return sorted(found.values(), key=lambda t: t.start_ns)[:limit]


def _error_message(resp: httpx.Response) -> str:
    """Jaeger's ``{"error": {"message": ...}}`` when present, else the start of the body."""
    try:
        err = resp.json().get("error") or {}
        if err.get("message"):
            return str(err["message"])
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        pass  # not Jaeger's JSON error object: the body below says what went wrong
    return resp.text[:200].strip() or resp.reason_phrase
