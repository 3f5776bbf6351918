"""The fleet monitor's Prometheus metrics: gauges from each published snapshot, counters
from the events the monitor reports.

Owns the writes to the fleet's metric families (declared, with their help texts, in the
gateway's metrics registry): `FleetMetrics` subscribes to the monitor's snapshots and
sets the per-replica state, readiness and score gauges and the per-domain cordon gauge;
the monitor calls it for restarts and failed deep probes, the hardware tickets for
tickets. Label values are only what the monitor knows (replica ids, failure domains,
states, score parts, bounded reasons), never client input.

Must not decide, do I/O, or import the gateway: it takes anything that has the metric
families (`FleetMetricFamilies`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from prometheus_client import Counter, Gauge

from seawall.fleet.view import FleetSnapshot, ReplicaView
from seawall.policy.health import State


class FleetMetricFamilies(Protocol):
    """The families the fleet writes (`seawall.gateway.metrics.Metrics` has them)."""

    @property
    def replica_state(self) -> Gauge: ...
    @property
    def replica_ready(self) -> Gauge: ...
    @property
    def replica_score(self) -> Gauge: ...
    @property
    def replica_score_part(self) -> Gauge: ...
    @property
    def restarts(self) -> Counter: ...
    @property
    def deep_probe_failures(self) -> Counter: ...
    @property
    def node_cordoned(self) -> Gauge: ...
    @property
    def hardware_tickets(self) -> Counter: ...


class FleetMetrics:
    def __init__(self, families: FleetMetricFamilies) -> None:
        self.m = families
        self._cordoned: frozenset[str] = frozenset()
        self._seen: Mapping[str, ReplicaView] = {}

    def on_snapshot(self, snap: FleetSnapshot) -> None:
        m = self.m
        seen, self._seen = self._seen, snap.replicas
        for rid, view in snap.changed_since(seen):
            for s in State:
                m.replica_state.labels(rid, view.node, s.value).set(1 if view.state == s else 0)
            m.replica_ready.labels(rid).set(1 if view.routable else 0)
            if view.health_score is not None:
                m.replica_score.labels(rid).set(view.health_score)
                for part, value in view.score_parts:
                    m.replica_score_part.labels(rid, part).set(value)
        for domain in snap.cordoned - self._cordoned:
            m.node_cordoned.labels(domain).set(1)
        for domain in self._cordoned - snap.cordoned:
            m.node_cordoned.labels(domain).set(0)
        self._cordoned = snap.cordoned

    def restarted(self, domain: str, reason: str) -> None:
        self.m.restarts.labels(domain, _reason_label(reason)).inc()

    def deep_probe_failed(self, replica_id: str) -> None:
        self.m.deep_probe_failures.labels(replica_id).inc()

    def ticket_opened(self, domain: str) -> None:
        self.m.hardware_tickets.labels(domain).inc()


def _reason_label(reason: str) -> str:
    """A bounded metric label: the transition reason without its free-text detail."""
    return reason.split(":", 1)[0][:60]
