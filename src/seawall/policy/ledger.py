"""Cordon policy over a restart history: when restarting a replica has stopped helping.

Why. A restart fixes a wedged process; it does not fix a bad GPU, a flaky NIC or a
driver that faults under load. On such a node the replica restarts, passes its health
check, serves for a while, hangs again, and restarts again: each cycle fails the
requests in flight and costs a full model load. After `k` restarts within `window_s`
the evidence points at the node, not the process, and the right move is to cordon it
(stop scheduling there, drain it, page a human) instead of restarting forever.

Only real restarts count. With actuator `none` (route around only) a failure restarts
nothing; the same replica fails, comes back and fails again, and that says nothing yet
about the hardware under it. Such failures are kept as `failure` records (shown to the
operator), never counted towards a cordon.

Failure domains. A node is the hardware that replicas share (a machine, a GPU host); a
replica configured without one is its own domain (`failure_domain`), so that one
replica's restarts never cordon another. And an operator's uncordon is a verdict on the
restarts before it: only restarts after the last uncordon count again.

Owns: the record type the ledger stores, failure-domain names and the k-in-window rule.
Must not: store anything (the SQLite ledger is in `seawall.state`), read the clock, or
cordon. The ledger outlives gateway restarts, so its times are wall-clock seconds
(`at_wall`); the caller passes `now` on the same clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

# The failure domain of a replica with no node: the replica alone. The prefix keeps the
# name apart from node names (a node may well be called "r0").
REPLICA_DOMAIN_PREFIX = "replica:"


def failure_domain(node: str | None, replica_id: str) -> str:
    """The name restarts are counted and cordons are kept under: the node when there is
    one, else the replica itself."""
    return node if node else f"{REPLICA_DOMAIN_PREFIX}{replica_id}"


def names_a_node(domain: str) -> bool:
    """False for a replica's own domain: there is no machine to cordon, only the replica."""
    return not domain.startswith(REPLICA_DOMAIN_PREFIX)


class RecordKind(StrEnum):
    restart = "restart"  # a process was (or is being) restarted: counts towards a cordon
    failure = "failure"  # a failure, and nothing was restarted: shown, never counted


@dataclass(frozen=True, slots=True)
class RestartRecord:
    """One restart (or failure), as written to the ledger."""

    node: str  # the failure domain (`failure_domain`)
    replica_id: str
    reason: str  # the transition reason from the state machine, e.g. "health check failed"
    at_wall: float  # Unix seconds
    kind: RecordKind = RecordKind.restart


def restarts_in_window(restart_times: Sequence[float], now: float, window_s: float) -> int:
    """How many restarts fall within the last `window_s` seconds (boundary included).

    A time after `now` counts too: a wall clock that stepped back must not make the
    ledger forget restarts that really happened.
    """
    return sum(1 for t in restart_times if now - t <= window_s)


def should_cordon(
    restart_times: Sequence[float],
    now: float,
    k: int,
    window_s: float,
    uncordoned_at: float | None = None,
) -> bool:
    """True when at least `k` restarts happened within `window_s` of `now` and after the
    operator last uncordoned the domain (`uncordoned_at`, None: never)."""
    if k < 1:
        raise ValueError("k must be >= 1")
    counted = [t for t in restart_times if uncordoned_at is None or t > uncordoned_at]
    return restarts_in_window(counted, now, window_s) >= k
