"""A circuit breaker on a whole remote pool: stop sending to an endpoint that keeps failing.

A remote pool (another region's Seawall, or any OpenAI-compatible endpoint over a WAN) is
one failure domain seen through one address. When it fails, it tends to fail every
request for a while, each after a long WAN timeout; sending to it meanwhile only adds
latency and load. The breaker opens after `failures` consecutive failed attempts, stays
open `open_s` (the pool counts as having no routable replica), then lets one trial
request through (half-open): a success closes it, a failure opens it again for
`open_s`. A success while closed resets the count. This is the classic breaker (Nygard,
"Release It!"; Finagle's FailFast, Envoy's outlier detection on a cluster), kept per
pool rather than per replica because the replicas behind a remote endpoint are not ours
to see.

Must not: read the clock (`now` is passed), or decide what counts as a failure (the
dispatcher's outcome rules do).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Circuit(StrEnum):
    closed = "closed"
    open = "open"
    half_open = "half_open"


@dataclass(frozen=True, slots=True)
class Breaker:
    failures: int = 5  # consecutive failures that open the circuit
    open_s: float = 10.0  # how long it stays open before one trial

    def __post_init__(self) -> None:
        if self.failures < 1 or self.open_s <= 0:
            raise ValueError("failures must be >= 1 and open_s > 0")


@dataclass(frozen=True, slots=True)
class BreakerState:
    circuit: Circuit = Circuit.closed
    consecutive_failures: int = 0
    opened_at: float = 0.0
    trial_in_flight: bool = False


def allows(b: Breaker, s: BreakerState, now: float) -> tuple[bool, BreakerState]:
    """May one more request go now? Returns the answer and the state after asking (an
    open circuit past its time turns half-open and lets exactly one trial through)."""
    if s.circuit is Circuit.closed:
        return True, s
    if s.circuit is Circuit.open:
        if now - s.opened_at < b.open_s:
            return False, s
        return True, BreakerState(Circuit.half_open, s.consecutive_failures, s.opened_at, True)
    # half-open: one trial at a time
    if s.trial_in_flight:
        return False, s
    return True, BreakerState(Circuit.half_open, s.consecutive_failures, s.opened_at, True)


def routable(b: Breaker, s: BreakerState, now: float) -> bool:
    """Whether the pool may be offered to routing now (without taking the trial)."""
    if s.circuit is Circuit.closed:
        return True
    if s.circuit is Circuit.open:
        return now - s.opened_at >= b.open_s
    return not s.trial_in_flight


def record(b: Breaker, s: BreakerState, ok: bool, now: float) -> BreakerState:
    """The outcome of an attempt on the pool."""
    if ok:
        return BreakerState()
    if s.circuit is Circuit.half_open:
        return BreakerState(Circuit.open, s.consecutive_failures + 1, now, False)
    failures = s.consecutive_failures + 1
    if s.circuit is Circuit.closed and failures >= b.failures:
        return BreakerState(Circuit.open, failures, now, False)
    return BreakerState(s.circuit, failures, s.opened_at, s.trial_in_flight)
