"""One rank's metrics (connector/transfer/metrics.py) over the fake transport: what the
transfer thread observes and publishes, and what the engine step drains."""

from __future__ import annotations

from connector.core import events as ev
from connector.core import messages as m
from connector.transfer.metrics import RankMetrics, Tee, key, outcome
from connector.transfer.spans import NO_SPANS
from connector.transfer.thread import TransferThread
from telemetry.schema import Metric
from tests.unit.test_endpoints import MS, Pair


class _Clock:
    def __init__(self, pair: Pair) -> None:
        self.pair = pair

    def __call__(self) -> int:
        return self.pair.now


def _wired(pair: Pair) -> tuple[TransferThread, TransferThread]:
    """Metrics on both ends of ``pair``, each behind a (not started) transfer thread."""
    threads = []
    for kw, end in (("sender", pair.sender), ("receiver", pair.receiver)):
        metrics = RankMetrics(0)
        end.spans = Tee(NO_SPANS, metrics)
        t = pair.tp if kw == "sender" else pair.td
        threads.append(
            TransferThread(t, end.peers, **{kw: end}, metrics=metrics, clock=_Clock(pair))
        )
    return threads[0], threads[1]


def _drain(thread: TransferThread) -> dict:
    assert thread.metrics is not None
    thread._publish()
    return thread.metrics.drain() or {}


def test_a_transfer_is_one_sample_per_histogram_and_one_count_per_side() -> None:
    pair = Pair()
    p, d = _wired(pair)
    pair.expect("t", 40, (9, 3, 5))
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1, 2, 3),), 40), pair.now)
    pair.pump()
    (report,) = pair.reports
    got = _drain(p)
    samples = got["samples"]
    assert samples[key(Metric.BYTES)] == [report.bytes_total] and report.bytes_total > 0
    assert samples[key(Metric.DESCRIPTORS)] == [report.descriptors]
    write = (report.done_ns - report.posted_ns) / 1e9
    assert samples[key(Metric.WRITE, "direct")] == [write]
    assert samples[key(Metric.WRITE_THROUGHPUT, "direct")] == [report.bytes_total / write]
    assert len(samples[key(Metric.PUSH)]) == 1 and len(samples[key(Metric.PREPARE)]) == 1
    # The prefill was handed over before D's registration was delivered.
    assert len(samples[key(Metric.RENDEZVOUS_WAIT, "prefill")]) == 1
    assert got["counts"] == {key(Metric.TRANSFERS, "send", "done", ""): 1}
    assert got["gauges"]["0"][Metric.BLOCKS_HELD.value] == 0
    d_got = _drain(d)
    assert len(d_got["samples"][key(Metric.KV_WAIT)]) == 1
    assert d_got["counts"] == {key(Metric.TRANSFERS, "recv", "done", ""): 1}
    assert d_got["gauges"]["0"] == {Metric.AWAITING_KV.value: 0}
    # Nothing new: nothing to send.
    assert _drain(p) == {} and _drain(d) == {}


def test_a_failed_write_counts_its_reason_on_both_sides_and_samples_nothing() -> None:
    pair = Pair()
    p, d = _wired(pair)
    pair.fabric.fail_writes("post", count=1)
    pair.expect("t", 32, (1, 2))
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1, 2),), 32), pair.now)
    pair.pump()
    got, d_got = _drain(p), _drain(d)
    assert got["samples"] == {} and d_got["samples"] == {}
    assert got["counts"] == {key(Metric.TRANSFERS, "send", "failed", "post_error"): 1}
    assert d_got["counts"] == {key(Metric.TRANSFERS, "recv", "failed", "post_error"): 1}


def test_gauges_show_held_blocks_and_their_age_then_go_back_to_zero() -> None:
    pair = Pair()
    p, _ = _wired(pair)
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1, 2, 3),), 40), pair.now)
    pair.now += 250 * MS
    gauges = _drain(p)["gauges"]["0"]
    assert gauges[Metric.PREFILLS_WAITING.value] == 1
    assert gauges[Metric.REGISTRATIONS_WAITING.value] == 0
    assert gauges[Metric.BLOCKS_HELD.value] == 3
    assert gauges[Metric.OLDEST_HELD.value] == 0.25
    pair.sender.on_event(ev.SourceReclaimed("t"), pair.now)  # vLLM took them back
    assert _drain(p) == {}, "no results went out: the census waits its turn"
    pair.now += 100 * MS
    got = _drain(p)
    assert got["gauges"]["0"][Metric.BLOCKS_HELD.value] == 0
    assert got["gauges"]["0"][Metric.PREFILLS_WAITING.value] == 0
    assert sum(got["counts"].values()) == 1


def test_a_stopped_prefill_ends_cancelled_not_needed() -> None:
    """First token from P that ends the request: P's transfer ends as not needed, which
    the dashboards count with cancellations, not failures."""
    pair = Pair()
    p, _ = _wired(pair)
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1,),), 16), pair.now)
    pair.sender.on_event(ev.SourceReclaimed("t", m.FailReason.NOT_NEEDED), pair.now)
    pair.now += 100 * MS
    counts = _drain(p)["counts"]
    assert counts == {key(Metric.TRANSFERS, "send", "cancelled", "not_needed"): 1}


def test_drops_are_counted_by_reason() -> None:
    pair = Pair()
    p, _ = _wired(pair)
    p._dispatch_frame("decode-0", m.MAGIC + b"\x93\x01", 0)
    pair.sender.on_message("someone-else", pair.register("t"), pair.now)
    counts = _drain(p)["counts"]
    assert counts[key(Metric.DROPPED, "malformed")] == 1
    assert counts[key(Metric.DROPPED, "sender_mismatch")] == 1


def test_outcome_labels() -> None:
    from connector.core.state import RecvState, SendState

    assert outcome(SendState.DONE, None) == outcome(RecvState.RECEIVED, None) == "done"
    assert outcome(SendState.EXPIRED, m.FailReason.LEASE_EXPIRED) == "expired"
    assert outcome(RecvState.FAILED, m.FailReason.DEADLINE) == "expired"
    assert outcome(RecvState.FAILED, m.FailReason.ABORTED) == "cancelled"
    assert outcome(SendState.FAILED, m.FailReason.WRITE_ERROR) == "failed"


def test_tee_calls_every_target_that_has_the_hook() -> None:
    calls: list[str] = []

    class A:
        def hook(self, x: int) -> None:
            calls.append(f"a{x}")

    class B:
        def hook(self, x: int) -> None:
            calls.append(f"b{x}")

    Tee(A(), object(), B()).hook(1)
    Tee(object()).missing(2)
    assert calls == ["a1", "b1"]
