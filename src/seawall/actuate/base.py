"""The actuator interface: how the fleet monitor acts on replicas and nodes.

The monitor decides (off the request path); an actuator only carries decisions out.
Three implementations: `none` (routing changes and records only), `local` (processes
Seawall started itself) and `kubernetes` (pods and nodes through the API server).

`restart` says whether anything was (or is being) restarted: only real restarts count
towards cordoning a failure domain (`seawall.policy.ledger`). `cordon` and `uncordon`
take a failure domain: a node name, or a replica's own domain (`replica:<id>`) for a
replica configured without a node, which only the actuators that know their replicas
(the local supervisor) can act on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from seawall.policy.ledger import failure_domain


@dataclass(frozen=True, slots=True)
class ReplicaRef:
    """Enough to find a replica's process or pod."""

    replica_id: str
    url: str
    node: str | None  # None: no node known; the replica is its own failure domain
    model: str = ""
    pod: str | None = None  # Kubernetes pod name, when known
    namespace: str | None = None
    # The pod's uid when known: a delete carries it as a precondition, so it can never
    # kill the replacement that a ReplicaSet (or a StatefulSet) started under the name.
    uid: str | None = None

    @property
    def domain(self) -> str:
        """The failure domain restarts are counted in and cordons apply to."""
        return failure_domain(self.node, self.replica_id)


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

    async def restart(self, replica: ReplicaRef, reason: str) -> bool:
        """Stop the replica's process (or pod) and start it again. True when a restart
        happened or is under way; False when nothing was restarted."""
        ...

    async def stop(self, replica: ReplicaRef, grace_s: float) -> None:
        """SIGTERM (or delete), then kill after `grace_s`."""

    async def cordon(self, node: str, evidence: Evidence) -> None:
        """Stop scheduling replicas in failure domain `node`."""

    async def uncordon(self, node: str) -> None: ...

    async def close(self) -> None: ...


class NoActuator:
    """`none`: the monitor changes routing and records; nothing is restarted."""

    name = "none"

    async def restart(self, replica: ReplicaRef, reason: str) -> bool:
        return False  # nothing restarted: the monitor records a failure, not a restart

    async def stop(self, replica: ReplicaRef, grace_s: float) -> None:
        return None

    async def cordon(self, node: str, evidence: Evidence) -> None:
        return None

    async def uncordon(self, node: str) -> None:
        return None

    async def close(self) -> None:
        return None
