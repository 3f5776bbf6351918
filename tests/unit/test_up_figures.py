"""The figures `seawall up` shows: gateway counters from a real metrics registry, and
traffic from load results, with time passed in."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from seawall.loadgen import RequestResult
from seawall.metrics import Metrics
from seawall.up.figures import (
    Crash,
    GatewayFigures,
    TrafficTally,
    combine,
    crash_outcome,
    histogram_quantile,
    parse_gateway_metrics,
)


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.1, 10.0), (0.2, 30.0), (float("inf"), 40.0)]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(
        0.15
    )  # rank 20: halfway through (0.1, 0.2]
    assert histogram_quantile(buckets, 0.25) == 0.1  # rank 10: the top of the first bucket
    assert histogram_quantile(buckets, 0.1) == pytest.approx(0.04)  # from 0, linearly
    assert histogram_quantile(buckets, 0.99) == 0.2  # in +Inf: the highest finite bound
    assert histogram_quantile([(float("inf"), 0.0)], 0.5) is None


def test_gateway_figures_come_from_the_gateways_own_metric_families() -> None:
    m = Metrics(process=False)
    m.requests.labels("m", "completions", "200").inc(7)
    m.requests.labels("m", "chat", "200").inc(3)
    m.requests.labels("m", "chat", "503").inc(2)
    m.retries.labels("connect_error").inc(4)
    for _ in range(10):
        m.ttft.labels("m").observe(0.02)
    figures = parse_gateway_metrics(generate_latest(m.registry).decode())
    assert (figures.requests_ok, figures.requests_failed, figures.retries) == (10, 2, 4)
    assert (figures.requests_dropped, figures.client_left) == (0, 0)
    assert figures.ttft_p50_s is not None and 0.01 < figures.ttft_p50_s <= 0.025


def test_a_gateway_with_no_traffic_yet_has_no_ttft() -> None:
    figures = parse_gateway_metrics(generate_latest(Metrics(process=False).registry).decode())
    assert figures.requests_ok == 0 and figures.ttft_p50_s is None


def done(tokens: int, outcome: str = "ok", ttft_s: float | None = 0.05) -> RequestResult:
    return RequestResult(outcome, 200, ttft_s, 1.0, tokens, outcome == "ok")  # type: ignore[arg-type]


def test_tokens_per_second_follow_the_last_window_not_the_whole_run() -> None:
    tally = TrafficTally(window_s=10.0)
    for t in range(20):  # 100 tokens/s for 20 s ...
        tally.add(done(100), now=1000.0 + t)
    assert tally.figures(now=1019.0).tokens_per_s == 100.0
    tally.add(done(0, "dropped"), now=1030.0)  # ... then nothing for 11 s
    figures = tally.figures(now=1030.0)
    assert figures.tokens_per_s == 0.0
    assert (figures.requests, figures.ok, figures.dropped, figures.tokens) == (21, 20, 1, 2000)


def test_the_first_seconds_are_not_diluted_by_an_empty_window() -> None:
    tally = TrafficTally(window_s=10.0)
    tally.add(
        RequestResult("ok", 200, 0.05, 1.0, 50, True, started_at=100.0), now=101.0
    )  # one request, started 2 s ago
    assert tally.figures(now=102.0).tokens_per_s == 25.0
    assert TrafficTally().figures(now=5.0).tokens_per_s == 0.0


def test_a_stream_cut_mid_way_is_dropped_not_ok() -> None:
    """The gateway's tally said "answered ok 431, failed 0" while the client saw "ok 430,
    dropped 1": a stream that broke after its 200 counted as ok. One truthful count."""
    m = Metrics(process=False)
    m.requests.labels("m", "chat", "200").inc(431)  # the status the client got first
    m.stream_errors.labels("upstream_reset").inc()  # ...and one of them then broke
    m.requests.labels("m", "chat", "499").inc(2)  # clients that left are not failures
    m.migrations.labels("ok").inc(3)
    m.inflight.labels("r0").set(2)
    figures = parse_gateway_metrics(generate_latest(m.registry).decode())
    assert (figures.requests_ok, figures.requests_dropped) == (430, 1)
    assert (figures.requests_failed, figures.client_left) == (0, 2)
    assert figures.migrations_ok == 3 and figures.inflight == {"r0": 2}


def gateway(
    ok: int = 0,
    failed: int = 0,
    dropped: int = 0,
    migrated: int = 0,
    retries: int = 0,
    resets: int = 0,
) -> GatewayFigures:
    return GatewayFigures(ok, failed, dropped, 0, None, retries, migrated, resets={"r1": resets})


def test_a_crash_whose_streams_all_migrated() -> None:
    crash = Crash("r1", in_flight=5, streaming=5, before=gateway(ok=100, migrated=1))
    out = crash_outcome(crash, gateway(ok=105, migrated=6))
    assert (out.migrated, out.retried, out.failed) == (5, 0, 0)
    assert out.text() == (
        "crash of r1 with 5 request(s) in flight (5 streaming): 5 migrated, 0 retried, "
        "0 failed (a plain proxy would have cut 5)"
    )


def test_a_crash_without_migration_drops_the_streams_and_retries_the_rest() -> None:
    crash = Crash("r1", in_flight=4, streaming=3, before=gateway(ok=10))
    out = crash_outcome(crash, gateway(ok=11, dropped=3, retries=1, resets=1))
    assert (out.in_flight, out.streaming) == (4, 3)
    assert (out.migrated, out.retried, out.failed) == (0, 1, 3)


def test_what_the_crash_cut_is_counted_after_it_not_sampled_before() -> None:
    """Sampled as the crash was sent: two streams. One ended before the crash landed
    (its [DONE] was already on the way), and a request sent meanwhile was cut before its
    first token. The report once said "1 not in the counts" for the first and called
    the second's retry a stream's; it counts what the crash cut."""
    crash = Crash("r1", in_flight=2, streaming=2, before=gateway(ok=10, retries=3))
    out = crash_outcome(crash, gateway(ok=13, migrated=1, retries=4, resets=1))
    assert (out.in_flight, out.streaming, out.migrated, out.retried) == (2, 1, 1, 1)
    assert (out.failed, out.unaccounted) == (0, 0)


def test_a_crash_report_credits_only_what_a_counter_saw() -> None:
    """Retries are the gateway's retry counter, not what is left over: an attempt cut
    before its first token that no retry or failure explains is reported as such."""
    crash = Crash("r1", in_flight=4, streaming=2, before=gateway(ok=10, retries=7))
    out = crash_outcome(crash, gateway(ok=12, migrated=2, retries=8, resets=2))
    assert (out.migrated, out.retried, out.failed, out.unaccounted) == (2, 1, 0, 1)
    assert out.text() == (
        "crash of r1 with 4 request(s) in flight (2 streaming): 2 migrated, 1 retried, "
        "0 failed, 1 not in the counts (a plain proxy would have cut 4)"
    )


def test_a_crash_report_charges_every_failure_since_to_the_crash() -> None:
    """Retries of requests that were never on the crashed replica (refused connections
    to it, other trouble) are not credited; failures anywhere are charged to it."""
    crash = Crash("r1", in_flight=2, streaming=2, before=gateway())
    out = crash_outcome(crash, gateway(failed=5, migrated=4, retries=9))
    assert (out.in_flight, out.migrated, out.retried, out.failed) == (4, 0, 0, 4)


def test_several_gateways_counts_add_up() -> None:
    a = GatewayFigures(10, 1, 2, 0, 0.02, 3, 1, {"r0": 2, "r1": 1})
    b = GatewayFigures(5, 0, 1, 1, 0.05, 0, 0, {"r1": 4})
    both = combine([a, b])
    assert (both.requests_ok, both.requests_failed, both.requests_dropped) == (15, 1, 3)
    assert (both.client_left, both.retries, both.migrations_ok) == (1, 3, 1)
    assert both.inflight == {"r0": 2, "r1": 5}
    assert combine([a]) == a
