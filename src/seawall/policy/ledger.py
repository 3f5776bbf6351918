"""Cordon policy over a restart history: when restarting a replica has stopped helping.

Why. A restart fixes a wedged process; it does not fix a bad GPU, a flaky NIC or a
driver that faults under load. On such a node the replica restarts, passes its health
check, serves for a while, hangs again, and restarts again: each cycle fails the
requests in flight and costs a full model load. After `k` restarts within `window_s`
the evidence points at the node, not the process, and the right move is to cordon it
(stop scheduling there, drain it, page a human) instead of restarting forever.

Owns: the record type the ledger stores and the k-in-window rule. Must not: store
anything (the SQLite ledger is in `seawall.state`), read the clock, or cordon. The
ledger outlives gateway restarts, so its times are wall-clock seconds (`at_wall`); the
caller passes `now` on the same clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestartRecord:
    """One restart, as written to the ledger."""

    node: str
    replica_id: str
    reason: str  # the transition reason from the state machine, e.g. "health check failed"
    at_wall: float  # Unix seconds


def restarts_in_window(restart_times: Sequence[float], now: float, window_s: float) -> int:
    """How many restarts fall within the last `window_s` seconds (boundary included).

    A time after `now` counts too: a wall clock that stepped back must not make the
    ledger forget restarts that really happened.
    """
    return sum(1 for t in restart_times if now - t <= window_s)


def should_cordon(restart_times: Sequence[float], now: float, k: int, window_s: float) -> bool:
    """True when at least `k` restarts happened within `window_s` of `now`."""
    if k < 1:
        raise ValueError("k must be >= 1")
    return restarts_in_window(restart_times, now, window_s) >= k
