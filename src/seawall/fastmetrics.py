"""A lock-free histogram for observations made on every streamed chunk.

prometheus_client's Histogram takes a lock and updates two synchronised values per
observation; on the relay path that was about 5% of the gateway's CPU (py-spy, see
bench/README.md). The gateway writes these from its one event-loop thread, and
`/metrics` is rendered on that same thread, so plain integers are enough. Exposed
through the registry as an ordinary histogram family: same names, same text format.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector


class _Child:
    __slots__ = ("_bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        # Prometheus buckets are upper-inclusive (le): bisect_left puts a value equal to
        # a bound into that bound's bucket.
        self.counts[bisect_left(self._bounds, value)] += 1
        self.total += value


class FastHistogram(Collector):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], _Child] = {}
        registry.register(self)

    def labels(self, *values: str) -> _Child:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}")
            child = self._children[values] = _Child(self.bounds)
        return child

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._children.items():
            cumulative, buckets = 0, []
            for bound, count in zip((*self.bounds, float("inf")), child.counts, strict=True):
                cumulative += count
                buckets.append((_le(bound), float(cumulative)))
            family.add_metric(list(values), buckets, child.total)
        yield family


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
