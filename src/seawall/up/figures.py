"""The numbers `seawall up` shows: traffic as its load generator saw it, and the gateway's
own counters read from its `/metrics`.

Pure: no I/O, no clock (`now` is an argument). The caller fetches `/metrics` text and
feeds load results in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from seawall.loadgen import RequestResult, percentile
from seawall.metrics import REQUESTS, RETRIES, TTFT


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
    requests_ok: int
    requests_failed: int  # any non-200 answer the gateway gave
    ttft_p50_s: float | None  # from the histogram buckets, as Prometheus would estimate it
    retries: int


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
    ok = failed = retries = 0.0
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == REQUESTS:
                if sample.labels.get("status") == "200":
                    ok += sample.value
                else:
                    failed += sample.value
            elif sample.name == RETRIES:
                retries += sample.value
            elif sample.name == TTFT + "_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return GatewayFigures(
        requests_ok=int(ok),
        requests_failed=int(failed),
        ttft_p50_s=histogram_quantile(list(buckets.items()), 0.5),
        retries=int(retries),
    )
