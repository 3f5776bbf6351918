"""The gateway's own view of each replica, as the fleet monitor reads it.

Owns the `GatewaySignals` protocol (streams in flight, chunks relayed, recent TTFT/ITL and
error rate per replica) and two implementations: `NoGatewaySignals` (a monitor without a
gateway) and `ReplicaSetSignals` (over the gateway's replica bookkeeping). Lives apart
from the monitor so that the gateway can implement it without importing the monitor.

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

    def streams_in_flight(self, replica_id: str) -> int: ...

    def chunks_relayed_total(self, replica_id: str) -> int: ...

    def observed(self, replica_id: str) -> Observed: ...


class NoGatewaySignals:
    """No gateway (tests, a standalone monitor): only the engine's view counts."""

    def streams_in_flight(self, replica_id: str) -> int:
        return 0

    def chunks_relayed_total(self, replica_id: str) -> int:
        return 0

    def observed(self, replica_id: str) -> Observed:
        return Observed()


class _GatewayReplica(Protocol):
    streams: int
    chunks_relayed: int
    ttft_ewma_s: float | None
    itl_ewma_s: float | None
    error_ewma: float


class _GatewayReplicas(Protocol):
    def get(self, replica_id: str) -> _GatewayReplica | None: ...


class ReplicaSetSignals:
    """`GatewaySignals` over the gateway's `ReplicaSet` (anything with `.get(id)` returning
    an object with `streams`, `chunks_relayed`, `ttft_ewma_s`, `itl_ewma_s`, `error_ewma`).

    The gateway keeps moving averages rather than percentiles; they stand in for p50.
    """

    def __init__(self, replicas: _GatewayReplicas) -> None:
        self._replicas = replicas

    def streams_in_flight(self, replica_id: str) -> int:
        r = self._replicas.get(replica_id)
        return r.streams if r is not None else 0

    def chunks_relayed_total(self, replica_id: str) -> int:
        r = self._replicas.get(replica_id)
        return r.chunks_relayed if r is not None else 0

    def observed(self, replica_id: str) -> Observed:
        r = self._replicas.get(replica_id)
        if r is None:
            return Observed()
        return Observed(r.ttft_ewma_s, r.itl_ewma_s, r.error_ewma)
