"""The numbers `seawall up` shows: traffic as its load generator saw it, and the gateway's
own counters read from its `/metrics`.

Pure: no I/O, no clock (`now` is an argument). The caller fetches `/metrics` text and
feeds load results in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from seawall.loadgen import RequestResult, percentile
from seawall.metrics import (
    INFLIGHT,
    MIGRATIONS,
    REQUESTS,
    RETRIES,
    STREAM_ERRORS,
    TTFT,
    UPSTREAM_ATTEMPTS,
)


@dataclass(frozen=True, slots=True)
class TrafficFigures:
    requests: int
    ok: int
    failed: int
    dropped: int
    cut: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tokens: int
    tokens_per_s: float  # over the last `window_s`


class TrafficTally:
    """Load results as they arrive; tokens/s over a sliding window so the figure moves
    with the traffic instead of averaging the whole run."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.counts = {"ok": 0, "failed": 0, "dropped": 0, "cut": 0}
        self.tokens = 0
        self.ttfts: list[float] = []
        self._recent: deque[tuple[float, int]] = deque()  # (finished at, tokens)
        self._first_at: float | None = None

    def add(self, result: RequestResult, now: float) -> None:
        self.counts[result.outcome] += 1
        self.tokens += result.tokens
        if result.ttft_s is not None:
            self.ttfts.append(result.ttft_s)
        if self._first_at is None:
            self._first_at = result.started_at or now
        self._recent.append((now, result.tokens))

    def figures(self, now: float) -> TrafficFigures:
        while self._recent and self._recent[0][0] <= now - self.window_s:
            self._recent.popleft()
        span_s = self.window_s
        if self._first_at is not None:
            span_s = min(self.window_s, max(now - self._first_at, 1e-9))
        recent_tokens = sum(t for _, t in self._recent)
        return TrafficFigures(
            requests=sum(self.counts.values()),
            ok=self.counts["ok"],
            failed=self.counts["failed"],
            dropped=self.counts["dropped"],
            cut=self.counts["cut"],
            ttft_p50_s=percentile(self.ttfts, 50),
            ttft_p99_s=percentile(self.ttfts, 99),
            tokens=self.tokens,
            tokens_per_s=recent_tokens / span_s if self._first_at is not None else 0.0,
        )


@dataclass(frozen=True, slots=True)
class GatewayFigures:
    """The gateway's own count of what it answered, in the client's categories: a stream
    that broke after its 200 is `dropped`, not ok (the status counter alone says 200)."""

    requests_ok: int  # answered 200 and, if streamed, ended with [DONE]
    requests_failed: int  # an error answer (not 200), the client's leaving aside
    requests_dropped: int  # streams that started and then ended with an error event
    client_left: int  # the client went away first (499 in the access log)
    ttft_p50_s: float | None  # from the histogram buckets, as Prometheus would estimate it
    retries: int
    migrations_ok: int = 0
    inflight: dict[str, int] = field(default_factory=dict)  # replica -> requests on it now
    # replica -> attempts there whose connection broke before the first token
    resets: dict[str, int] = field(default_factory=dict)


def combine(figures: list[GatewayFigures]) -> GatewayFigures:
    """Several gateways' counts as one: sums, and in flight per replica summed; the TTFT
    estimate is the first's (histograms are not kept here to merge)."""
    inflight: dict[str, int] = {}
    resets: dict[str, int] = {}
    for f in figures:
        for rid, n in f.inflight.items():
            inflight[rid] = inflight.get(rid, 0) + n
        for rid, n in f.resets.items():
            resets[rid] = resets.get(rid, 0) + n
    return GatewayFigures(
        requests_ok=sum(f.requests_ok for f in figures),
        requests_failed=sum(f.requests_failed for f in figures),
        requests_dropped=sum(f.requests_dropped for f in figures),
        client_left=sum(f.client_left for f in figures),
        ttft_p50_s=figures[0].ttft_p50_s,
        retries=sum(f.retries for f in figures),
        migrations_ok=sum(f.migrations_ok for f in figures),
        inflight=inflight,
        resets=resets,
    )


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' `histogram_quantile`: linear within the bucket holding the rank.
    `buckets` are (upper bound, cumulative count), any order; +Inf included."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    total = ordered[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for upper, count in ordered:
        if count >= rank:
            if math.isinf(upper):
                return lower_bound  # the highest finite bound is all we know
            if count == lower_count:
                return upper
            return lower_bound + (upper - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = upper, count
    return None


def parse_gateway_metrics(text: str) -> GatewayFigures:
    answered_200 = failed = left = retries = dropped = migrated = 0.0
    buckets: dict[float, float] = {}
    inflight: dict[str, int] = {}
    resets: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == REQUESTS:
                status = sample.labels.get("status")
                if status == "200":
                    answered_200 += sample.value
                elif status == "499":
                    left += sample.value
                else:
                    failed += sample.value
            elif name == STREAM_ERRORS:
                dropped += sample.value
            elif name == MIGRATIONS:
                if sample.labels.get("outcome") == "ok":
                    migrated += sample.value
            elif name == RETRIES:
                retries += sample.value
            elif name == INFLIGHT:
                inflight[sample.labels["replica"]] = int(sample.value)
            elif name == UPSTREAM_ATTEMPTS and sample.labels.get("outcome") == "reset":
                rid = sample.labels["replica"]
                resets[rid] = resets.get(rid, 0.0) + sample.value
            elif name == TTFT + "_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return GatewayFigures(
        requests_ok=int(answered_200 - dropped),
        requests_failed=int(failed),
        requests_dropped=int(dropped),
        client_left=int(left),
        ttft_p50_s=histogram_quantile(list(buckets.items()), 0.5),
        retries=int(retries),
        migrations_ok=int(migrated),
        inflight=inflight,
        resets={rid: int(n) for rid, n in resets.items()},
    )


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's load as the live view shows it."""

    in_flight: int | None  # requests the gateway has on it; None: no gateway to ask
    kv_usage: float | None  # the engine's KV cache use in [0, 1], as last scraped
    score: float | None  # the routing score in (0, 1]; None: not judged yet


@dataclass(frozen=True, slots=True)
class Crash:
    """A replica crashed on purpose, and the gateway's counts just before."""

    replica: str
    in_flight: int  # requests on it as the crash was sent
    streaming: int  # of those, streams the client was already reading
    before: GatewayFigures


@dataclass(frozen=True, slots=True)
class CrashOutcome:
    replica: str
    in_flight: int  # requests the crash cut, from the gateway's counters
    streaming: int  # of those, streams the client was already reading
    migrated: int  # streams that went on from another replica
    retried: int  # requests before their first token, answered by another replica
    failed: int  # dropped streams and error answers since the crash
    unaccounted: int = 0  # cut, but in none of the gateway's counts since

    def text(self) -> str:
        rest = f", {self.unaccounted} not in the counts" if self.unaccounted else ""
        return (
            f"crash of {self.replica} with {self.in_flight} request(s) in flight "
            f"({self.streaming} streaming): {self.migrated} migrated, {self.retried} retried, "
            f"{self.failed} failed{rest} (a plain proxy would have cut {self.in_flight})"
        )


def crash_outcome(crash: Crash, after: GatewayFigures) -> CrashOutcome:
    """What became of the requests a crash cut, from the gateway's counts before and
    after (read once the replica had nothing left in flight).

    What was cut is counted after the fact, not sampled before: the in-flight count read
    as the crash is sent misses a stream that ends, or a request that starts, while the
    crash is on its way (a few milliseconds; it made the demo's report wrong one run in
    four). Cut: every stream that broke (it migrated, or it was dropped) and every attempt
    on the replica whose connection broke before its first token. Then each outcome from
    its own counter: every failure the gateway counted since is charged to the crash (so
    unrelated failures can only make Seawall look worse), then the migrations, then the
    retries (at most the attempts cut before a token). What no counter explains is shown
    as such, not credited as saved."""
    b = crash.before
    migrated = max(0, after.migrations_ok - b.migrations_ok)
    dropped = max(0, after.requests_dropped - b.requests_dropped)
    reset = max(0, after.resets.get(crash.replica, 0) - b.resets.get(crash.replica, 0))
    streams = migrated + dropped
    cut = streams + reset
    failed = min(cut, dropped + max(0, after.requests_failed - b.requests_failed))
    left = cut - failed
    migrated = min(migrated, left)
    retried = min(max(0, after.retries - b.retries), reset, left - migrated)
    return CrashOutcome(
        replica=crash.replica,
        in_flight=cut,
        streaming=streams,
        migrated=migrated,
        retried=retried,
        failed=failed,
        unaccounted=left - migrated - retried,
    )
