"""The gateway's own view of each replica, as the fleet monitor reads it.

Owns the `GatewaySignals` protocol (requests and streams in flight, chunks relayed, recent
TTFT/ITL and error rate per replica, and waiting for a replica to be idle) and
`NoGatewaySignals` (a monitor without a gateway). The gateway implements the protocol over
its in-flight ledger (`gateway.replicas.ReplicaSignals`). Lives apart from the monitor so
that the gateway can implement it without importing the monitor.

Must not: compute anything (the gateway keeps the counts) or do I/O.
"""

from __future__ import annotations

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
