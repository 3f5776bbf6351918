"""The fleet view: what the fleet monitor publishes and the request path reads.

The request path never waits on the fleet. Monitors (scraper, prober, watchdog) build a
new immutable `FleetSnapshot` and swap it in; the gateway reads the current one per
request. Everything here is plain data.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from seawall.policy.load import EngineLoad

__all__ = ["EngineLoad", "FleetSnapshot", "ReplicaView"]


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What routing needs to know about one replica, at one moment."""

    replica_id: str
    url: str
    model: str
    node: str  # the failure domain: the node, or `replica:<id>` for a replica without one
    routable: bool = True  # ready, not draining, not cordoned, not stuck
    state: str = "ready"
    reason: str = ""
    score: float = 1.0  # routing score in (0, 1]: health score x the state's weight
    load: EngineLoad | None = None
    saturated: bool = False  # admission: no new work while true
    saturation_reason: str = ""
    held: bool = False  # an operator holds it out of routing (drain without restart)
    # The engine kind its metrics identify (fleet.adapters.EngineKind values), or the one
    # configured; "" while unknown. The request path asks each engine for per-chunk token
    # counts in its own dialect (migration needs them).
    engine: str = ""
    # The engine gives no load view (see `TrackedReplica.no_metrics`): `load` stays None
    # and admission counts only what this gateway sends. Otherwise a None `load` means
    # "not scraped yet", and admission waits for it.
    no_metrics: bool = False
    health_score: float | None = None  # the health score alone; None before the first
    score_parts: tuple[tuple[str, float], ...] = ()  # its factors, for the metrics


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    replicas: dict[str, ReplicaView] = field(default_factory=dict)
    taken_at: float = 0.0
    cordoned: frozenset[str] = frozenset()  # failure domains out of service

    def changed_since(self, seen: Mapping[str, ReplicaView]) -> Iterator[tuple[str, ReplicaView]]:
        """The replicas whose view is not the object `seen` (an earlier snapshot's
        `replicas`) holds. The fleet monitor keeps the view object of a replica whose view
        did not change, so a subscriber can pass over the rest."""
        for rid, view in self.replicas.items():
            if seen.get(rid) is not view:
                yield rid, view
