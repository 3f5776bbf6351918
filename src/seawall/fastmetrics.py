"""A lock-free histogram for observations made on every streamed chunk, and a cache of a
labelled family's children for label sets looked up on every request.

prometheus_client's Histogram takes a lock and updates two synchronised values per
observation; on the relay path that was about 5% of the gateway's CPU (py-spy, see
bench/README.md). The gateway writes these from its one event-loop thread, and
`/metrics` is rendered on that same thread, so plain integers are enough. Exposed
through the registry as an ordinary histogram family: same names, same text format.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Generic, Protocol, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

C = TypeVar("C", covariant=True)


class _Labelled(Protocol[C]):
    def labels(self, *values: str) -> C: ...


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


class Children(Generic[C]):
    """A labelled family's children by a dict lookup: prometheus_client's `labels()`
    converts and checks every value and takes a lock, several times the cost of the
    `inc()` after it, for label sets the request path asks for on every request. A child
    removed from its family must be forgotten here too (`clear`), or its increments
    would go to a series that is no longer exported."""

    __slots__ = ("_children", "_family")

    def __init__(self, family: _Labelled[C]) -> None:
        self._family = family
        self._children: dict[tuple[str, ...], C] = {}

    def __call__(self, *values: str) -> C:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._family.labels(*values)
        return child

    def clear(self) -> None:
        self._children.clear()


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
