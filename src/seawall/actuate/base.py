"""The actuator interface: how the fleet monitor acts on replicas and nodes.

The monitor decides (off the request path); an actuator only carries decisions out.
Three implementations: `none` (routing changes and records only), `local` (processes
Seawall started itself) and `kubernetes` (pods and nodes through the API server).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ReplicaRef:
    """Enough to find a replica's process or pod."""

    replica_id: str
    url: str
    node: str
    model: str = ""
    pod: str | None = None  # Kubernetes pod name, when known
    namespace: str | None = None


@dataclass(frozen=True, slots=True)
class DrainReport:
    replica_id: str
    streams_cut: int  # in-flight streams still open when the deadline hit
    exited: bool


@dataclass(frozen=True, slots=True)
class Evidence:
    """Why a node was cordoned: shown in the hardware ticket."""

    node: str
    reasons: tuple[str, ...]
    restarts: tuple[tuple[float, str, str], ...] = ()  # (unix time, replica, reason)
    extra: dict[str, str] = field(default_factory=dict)


class Actuator(Protocol):
    name: str

    async def restart(self, replica: ReplicaRef, reason: str) -> None:
        """Stop the replica's process (or pod) and start it again."""

    async def stop(self, replica: ReplicaRef, grace_s: float) -> None:
        """SIGTERM (or delete), then kill after `grace_s`."""

    async def cordon(self, node: str, evidence: Evidence) -> None:
        """Stop scheduling replicas on `node`."""

    async def uncordon(self, node: str) -> None: ...

    async def close(self) -> None: ...


class NoActuator:
    """`none`: the monitor changes routing and records; nothing is restarted."""

    name = "none"

    async def restart(self, replica: ReplicaRef, reason: str) -> None:
        return None

    async def stop(self, replica: ReplicaRef, grace_s: float) -> None:
        return None

    async def cordon(self, node: str, evidence: Evidence) -> None:
        return None

    async def uncordon(self, node: str) -> None:
        return None

    async def close(self) -> None:
        return None
