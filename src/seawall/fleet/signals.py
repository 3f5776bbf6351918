"""The gateway's own view of each replica, as the fleet monitor reads it.

Owns the `GatewaySignals` protocol (requests and streams in flight, chunks relayed, recent
TTFT/ITL and error rate per replica, and waiting for a replica to be idle) and
`NoGatewaySignals` (a monitor without a gateway). The gateway implements the protocol over
its in-flight ledger (`gateway.replicas.ReplicaSignals`). Lives apart from the monitor so
that the gateway can implement it without importing the monitor.

Several gateway instances: `FleetWideSignals` is the leader's `GatewaySignals`, its own
counts plus every other live instance's (`PeerCounts`, from their heartbeats, kept by
`seawall.cluster.roles.Peers`). A restart-drain then waits until no instance has anything
in flight on the replica, and the watchdog sees every instance's streams and chunks.

Must not: compute anything beyond those sums (the gateway keeps the counts) or do I/O.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Observed:
    """What the gateway saw from one replica over a recent window."""

    ttft_p50_s: float | None = None
    itl_p50_s: float | None = None
    error_rate: float | None = None  # 0..1


class GatewaySignals(Protocol):
    """The gateway's own view of each replica; the monitor only reads it."""

    def requests_in_flight(self, replica_id: str) -> int:
        """Every request on the replica now, streamed or not."""
        ...

    def streams_in_flight(self, replica_id: str) -> int:
        """Streaming responses being relayed from the replica now."""
        ...

    async def wait_idle(self, replica_id: str, deadline: float) -> int:
        """Until nothing is in flight on the replica (streamed or not), or the monotonic
        `deadline`; returns how many requests are still in flight then."""
        ...

    def chunks_relayed_total(self, replica_id: str) -> int: ...

    def observed(self, replica_id: str) -> Observed: ...


class NoGatewaySignals:
    """No gateway (tests, a standalone monitor): only the engine's view counts."""

    def requests_in_flight(self, replica_id: str) -> int:
        return 0

    def streams_in_flight(self, replica_id: str) -> int:
        return 0

    async def wait_idle(self, replica_id: str, deadline: float) -> int:
        return 0

    def chunks_relayed_total(self, replica_id: str) -> int:
        return 0

    def observed(self, replica_id: str) -> Observed:
        return Observed()


class PeerCounts(Protocol):
    """The other live instances' counts for a replica, from their latest reports."""

    def requests(self, replica_id: str) -> int: ...

    def streams(self, replica_id: str) -> int: ...

    def chunks_relayed_total(self, replica_id: str) -> int:
        """Cumulative over every instance that ever reported (never goes down when an
        instance leaves: the watchdog would take the drop for progress)."""
        ...

    def observed(self, replica_id: str) -> list[Observed]: ...

    async def wait_idle(self, replica_id: str, deadline: float) -> int:
        """Until every live instance has applied the view that took the replica out of
        routing and reports nothing in flight on it, or `deadline`; returns how many
        requests they still report then."""
        ...


class FleetWideSignals:
    """This instance's `GatewaySignals` plus its peers': what the leader's monitor reads."""

    def __init__(self, local: GatewaySignals, peers: PeerCounts) -> None:
        self.local = local
        self.peers = peers

    def requests_in_flight(self, replica_id: str) -> int:
        return self.local.requests_in_flight(replica_id) + self.peers.requests(replica_id)

    def streams_in_flight(self, replica_id: str) -> int:
        return self.local.streams_in_flight(replica_id) + self.peers.streams(replica_id)

    def chunks_relayed_total(self, replica_id: str) -> int:
        return self.local.chunks_relayed_total(replica_id) + self.peers.chunks_relayed_total(
            replica_id
        )

    def observed(self, replica_id: str) -> Observed:
        """The mean of what the instances that relayed anything from the replica saw."""
        seen = [self.local.observed(replica_id), *self.peers.observed(replica_id)]
        return Observed(
            _mean(o.ttft_p50_s for o in seen),
            _mean(o.itl_p50_s for o in seen),
            _mean(o.error_rate for o in seen if o.ttft_p50_s is not None or o.error_rate),
        )

    async def wait_idle(self, replica_id: str, deadline: float) -> int:
        """Ours first (an event on our ledger), then theirs (their next reports)."""
        await self.local.wait_idle(replica_id, deadline)
        theirs = await self.peers.wait_idle(replica_id, deadline)
        return self.local.requests_in_flight(replica_id) + theirs


def _mean(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None
