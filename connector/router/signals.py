"""The engines' own load, read from each backend's vLLM ``/metrics``.

Owns: ``parse_signals`` (the Prometheus text of one engine -> ``policy.Signals``; pure) and
``scrape`` (one backend's ``GET /metrics`` under a bounded timeout; a failure leaves the
last signals in place, which go stale and are then ignored by ``chooser``).

Names read, the same in vLLM 0.26 and 0.32 (vllm/v1/metrics/loggers.py): the gauges
``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and
``vllm:kv_cache_usage_perc`` (a fraction, despite its name); vLLM's v0 engine called the
last ``vllm:gpu_cache_usage_perc``, read when the first is absent. Samples of several
engines (data parallel: an ``engine`` label each) are summed, KV usage averaged.

Must not import: starlette, uvicorn, ``connector.router.app`` / ``relay``.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import TYPE_CHECKING

from connector.router.policy import Signals
from connector.router.upstream import TransportError

if TYPE_CHECKING:
    from connector.router.backends import Backend

logger = logging.getLogger(__name__)

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_WANTED = (WAITING, RUNNING, *KV_USAGE)
# name, optional {labels}, value: the label set is skipped, not parsed
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{.*\})?\s+(\S+)")


def parse_signals(text: str, at: float) -> Signals | None:
    """The queue and KV usage in one engine's metrics text; None without the queue
    gauges (not a vLLM server, or its metrics are off)."""
    values: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line.startswith(_WANTED):
            continue  # most of vLLM's ~1000 lines: histograms we do not read
        m = _SAMPLE.match(line)
        if m is None or m[1] not in _WANTED:
            continue  # e.g. vllm:num_requests_waiting_by_reason
        try:
            values.setdefault(m[1], []).append(float(m[2]))
        except ValueError:
            continue
    if WAITING not in values or RUNNING not in values:
        return None
    kv = next((values[k] for k in KV_USAGE if k in values), [0.0])
    return Signals(
        waiting=sum(values[WAITING]),
        running=sum(values[RUNNING]),
        kv_usage=min(1.0, max(0.0, sum(kv) / len(kv))),
        at=at,
    )


async def scrape(b: Backend, timeout_s: float) -> bool:
    """Read ``b``'s signals into ``b.load.signals``; False (and the old ones kept) when
    its /metrics could not be read or named no queue."""
    try:
        r = await b.http.request("GET", "/metrics", timeout_s=timeout_s)
    except TransportError as exc:
        logger.debug("router backend %s: /metrics: %s", b.name, exc)
        return False
    if r.status_code != 200:
        logger.debug("router backend %s: /metrics answered %d", b.name, r.status_code)
        return False
    now = asyncio.get_running_loop().time()  # the clock the chooser reads
    s = parse_signals(r.content.decode("utf-8", "replace"), now)
    if s is None:
        logger.debug("router backend %s: /metrics has no %s", b.name, WAITING)
        return False
    b.load.signals = s
    return True
