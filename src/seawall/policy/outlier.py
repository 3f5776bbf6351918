"""Passive outlier detection: a replica whose requests keep failing is ejected for a while,
judged only from the requests this gateway instance relays.

Why. A follower instance probes nothing (the fleet leader does, once for the fleet), so
between two views, and while the leader or the store is gone, the requests it relays
are all it knows. Envoy's consecutive-failure rule is the well-worn answer: after
`consecutive_failures` replica faults in a row (connection errors, timeouts before the
first token, 5xx, streams the replica broke; never the client's own errors), eject the
replica for `ejection_s`, twice as long at each repeat (up to `max_ejection_s`), and
reset the repeat count once a request succeeds again. Ejections are capped at
`max_ejected_fraction` of a model's replicas (never the only one): when most replicas
fail, the fault is more likely ours or upstream of them, and ejecting them all would
turn degraded service into none.

Must not: read the clock, do I/O, or know the gateway's records (the caller keeps the
state and the ejection deadline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OutlierRule:
    consecutive_failures: int = 5
    ejection_s: float = 5.0
    max_ejection_s: float = 60.0
    max_ejected_fraction: float = 0.5


@dataclass(frozen=True, slots=True)
class OutlierState:
    failures: int = 0  # replica faults in a row
    ejections: int = 0  # ejections since the last success


def observe(state: OutlierState, ok: bool, rule: OutlierRule) -> tuple[OutlierState, bool]:
    """One relayed request's outcome: the new state, and whether to eject now."""
    if ok:
        return OutlierState(), False
    failures = state.failures + 1
    if failures >= rule.consecutive_failures:
        return OutlierState(0, state.ejections + 1), True
    return OutlierState(failures, state.ejections), False


def ejection_s(ejections: int, rule: OutlierRule) -> float:
    """How long the `ejections`-th ejection in a row lasts."""
    return min(rule.max_ejection_s, rule.ejection_s * 2.0 ** max(0, ejections - 1))


def may_eject(ejected: int, replicas: int, rule: OutlierRule) -> bool:
    """Whether one more of a model's `replicas` may be ejected while `ejected` are."""
    return ejected + 1 <= math.floor(replicas * rule.max_ejected_fraction)
