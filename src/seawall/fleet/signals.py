"""The gateway's own view of each replica, as the fleet monitor reads it.

Owns the `GatewaySignals` protocol (requests and streams in flight, chunks relayed,
recent TTFT/ITL and error rate per replica, and waiting until a replica is idle) and two
implementations: `NoGatewaySignals` (a monitor without a gateway) and
`ReplicaSetSignals` (over the gateway's replica bookkeeping). Lives apart from the
monitor so that the gateway can implement it without importing the monitor.

Must not: compute anything (the gateway keeps the counts) or do other I/O than waiting.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from seawall import clock

# `ReplicaSetSignals.wait_idle` polls the gateway's counter this often. A stop-gap: the
# gateway's in-flight ledger will wake waiters when a replica's count reaches zero.
_IDLE_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Observed:
    """What the gateway saw from one replica over a recent window."""

    ttft_p50_s: float | None = None
    itl_p50_s: float | None = None
    error_rate: float | None = None  # 0..1


class GatewaySignals(Protocol):
    """The gateway's own view of each replica; the monitor only reads it."""

    def streams_in_flight(self, replica_id: str) -> int:
        """Streaming responses being relayed from the replica now."""
        ...

    def requests_in_flight(self, replica_id: str) -> int:
        """Every request on the replica now, streamed or not."""
        ...

    async def wait_idle(self, replica_id: str, deadline: float) -> int:
        """Return once nothing is in flight on the replica, or at the monotonic
        `deadline`, with how many requests are still in flight (0: idle)."""
        ...

    def chunks_relayed_total(self, replica_id: str) -> int: ...

    def observed(self, replica_id: str) -> Observed: ...


class NoGatewaySignals:
    """No gateway (tests, a standalone monitor): only the engine's view counts."""

    def streams_in_flight(self, replica_id: str) -> int:
        return 0

    def requests_in_flight(self, replica_id: str) -> int:
        return 0

    async def wait_idle(self, replica_id: str, deadline: float) -> int:
        return 0

    def chunks_relayed_total(self, replica_id: str) -> int:
        return 0

    def observed(self, replica_id: str) -> Observed:
        return Observed()


class _GatewayReplica(Protocol):
    inflight: int
    streams: int
    chunks_relayed: int
    ttft_ewma_s: float | None
    itl_ewma_s: float | None
    error_ewma: float


class _GatewayReplicas(Protocol):
    def get(self, replica_id: str) -> _GatewayReplica | None: ...


class ReplicaSetSignals:
    """`GatewaySignals` over the gateway's `ReplicaSet` (anything with `.get(id)` returning
    an object with `inflight`, `streams`, `chunks_relayed`, `ttft_ewma_s`, `itl_ewma_s`,
    `error_ewma`). A replica the gateway no longer knows has nothing in flight.

    The gateway keeps moving averages rather than percentiles; they stand in for p50.
    """

    def __init__(self, replicas: _GatewayReplicas) -> None:
        self._replicas = replicas

    def streams_in_flight(self, replica_id: str) -> int:
        r = self._replicas.get(replica_id)
        return r.streams if r is not None else 0

    def requests_in_flight(self, replica_id: str) -> int:
        r = self._replicas.get(replica_id)
        return r.inflight if r is not None else 0

    async def wait_idle(self, replica_id: str, deadline: float) -> int:
        while (left := self.requests_in_flight(replica_id)) > 0 and clock.monotonic() < deadline:
            await asyncio.sleep(min(_IDLE_POLL_S, max(0.0, deadline - clock.monotonic())))
        return left

    def chunks_relayed_total(self, replica_id: str) -> int:
        r = self._replicas.get(replica_id)
        return r.chunks_relayed if r is not None else 0

    def observed(self, replica_id: str) -> Observed:
        r = self._replicas.get(replica_id)
        if r is None:
            return Observed()
        return Observed(r.ttft_ewma_s, r.itl_ewma_s, r.error_ewma)
