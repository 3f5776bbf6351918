"""Pools: which group of replicas serves a model now, and where one request may go when
that group cannot take it.

A pool is a group of replicas that fail together: a region, a cluster, a hardware
class. Pools have a priority (0 first) and a mode. Active pools take traffic in priority
order; a passive pool takes none while a pool before it serves, except the deep probes
and warm-up that keep it proven. The failure-domain map's largest domain is the pool:
"a fleet-level loss should be absorbed by spare capacity or another region".

Two decisions, on two time scales:

1. Where traffic goes (`step`, per model, with hysteresis). The serving pool is the
   first pool in priority order that is healthy (has a routable replica). Leaving it is a
   *failover*, taken only when it has had no routable replica for `failover_after_s`:
   one bad probe takes a replica out of routing for a second, and that must not move a
   region's traffic across a WAN. Coming back to a better pool after a failover is a
   *failback*, taken only when that pool has stayed healthy for `failback_after_s`
   without a break, so that a pool that flaps does not take traffic back and forth. Both
   are events. Before any failover (a fleet starting, its pools coming up in any order)
   the serving pool moves up to a better pool as soon as that pool is healthy: there is
   nothing to fail back from.
2. Where one request may go (`route_order`, `may_leave`, `may_enter`), at once. The
   serving pool first, then the tier's other pools in its order: to *overflow* (the
   pool is saturated: admission would shed) if the tier allows it, into active pools
   only (a passive pool takes no traffic while the pool before it is healthy, and a
   saturated pool is healthy); and to *fail over* (the pool has no routable replica at
   this moment, before the selector has moved) if the tier allows it, into any pool. A
   request must not fail for want of hysteresis. A tier that may not leave
   its first pool is shed (429) when that pool is saturated and refused (503) when it
   has no routable replica; its first pool stays its own even after the fleet failed
   over (a free tier may be shed rather than sent across regions).

Must not: read the clock (`now` is passed), route a request (the dispatcher asks), or
know what a replica is (a pool's health is two numbers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    priority: int = 0  # 0 is served first
    passive: bool = False  # takes traffic only when the pools before it cannot


@dataclass(frozen=True, slots=True)
class PoolHealth:
    """One pool, for one model, now."""

    routable: int  # replicas of the pool serving the model that may take new work
    saturated: bool = False  # every routable replica is saturated (admission would shed)

    @property
    def healthy(self) -> bool:
        return self.routable > 0


@dataclass(frozen=True, slots=True)
class TierPools:
    """A tier's use of pools. `order=()` means every pool in priority order."""

    order: tuple[str, ...] = ()
    overflow: bool = True  # may go to the next pool when its pool is saturated
    failover: bool = True  # may go to the next pool when its pool has no routable replica


class Change(StrEnum):
    failover = "failover"
    failback = "failback"
    first = "first"  # the model's first serving pool (no traffic moved)


@dataclass(frozen=True, slots=True)
class PoolEvent:
    change: Change
    model: str
    from_pool: str | None
    to_pool: str | None
    at: float
    reason: str


@dataclass(frozen=True, slots=True)
class SelectorState:
    """Per model: the serving pool and, per pool, since when it has been healthy
    (None: unhealthy) and unhealthy (None: healthy)."""

    serving: str | None = None
    healthy_since: Mapping[str, float | None] = field(default_factory=dict)
    unhealthy_since: Mapping[str, float | None] = field(default_factory=dict)
    failed_over: bool = False  # the serving pool was reached by a failover


def ordered(pools: Sequence[PoolSpec]) -> tuple[PoolSpec, ...]:
    """Priority order; passive pools after active ones of the same priority; then name."""
    return tuple(sorted(pools, key=lambda p: (p.priority, p.passive, p.name)))


def step(
    state: SelectorState,
    model: str,
    pools: Sequence[PoolSpec],
    health: Mapping[str, PoolHealth],
    now: float,
    failover_after_s: float,
    failback_after_s: float,
) -> tuple[SelectorState, tuple[PoolEvent, ...]]:
    """The model's serving pool after observing `health` at `now` (see the module doc)."""
    names = [p.name for p in ordered(pools)]
    healthy_since: dict[str, float | None] = {}
    unhealthy_since: dict[str, float | None] = {}
    for name in names:
        h = health.get(name)
        ok = h is not None and h.healthy
        was_healthy = state.healthy_since.get(name)
        was_unhealthy = state.unhealthy_since.get(name)
        healthy_since[name] = (was_healthy if was_healthy is not None else now) if ok else None
        unhealthy_since[name] = (
            None if ok else (was_unhealthy if was_unhealthy is not None else now)
        )
    events: list[PoolEvent] = []
    serving = state.serving if state.serving in names else None
    failed_over = state.failed_over and serving is not None
    if serving is None:
        first = next(
            (n for n in names if healthy_since[n] is not None), names[0] if names else None
        )
        if first is not None:
            events.append(PoolEvent(Change.first, model, None, first, now, "first serving pool"))
        serving = first
    else:
        # Failover: the serving pool has been down long enough, and a later one is up.
        down_since = unhealthy_since.get(serving)
        if down_since is not None and now - down_since >= failover_after_s:
            to = next((n for n in names if n != serving and healthy_since[n] is not None), None)
            if to is not None:
                events.append(
                    PoolEvent(
                        Change.failover,
                        model,
                        serving,
                        to,
                        now,
                        f"{serving} had no routable replica for {now - down_since:.1f} s",
                    )
                )
                serving, failed_over = to, True
        # Back to a better pool: after a failover, once it has been up long enough;
        # before any (the fleet coming up), as soon as it is up.
        hold = failback_after_s if failed_over else 0.0
        better = names[: names.index(serving)] if serving in names else []
        back = next(
            (n for n in better if (since := healthy_since[n]) is not None and now - since >= hold),
            None,
        )
        if back is not None:
            since = healthy_since[back]
            assert since is not None
            if failed_over:
                events.append(
                    PoolEvent(
                        Change.failback,
                        model,
                        serving,
                        back,
                        now,
                        f"{back} healthy again for {now - since:.1f} s",
                    )
                )
            else:
                events.append(
                    PoolEvent(Change.first, model, serving, back, now, "a better pool is up")
                )
            serving = back
            failed_over = failed_over and back != names[0]
    return SelectorState(serving, healthy_since, unhealthy_since, failed_over), tuple(events)


def route_order(serving: str | None, pools: Sequence[PoolSpec], tier: TierPools) -> tuple[str, ...]:
    """The pools one request of `tier` may try, in order: the tier's own order (default:
    the pools' priority). A tier that may fail over leaves the pools the fleet has failed
    over from (those ranked above the one serving now) for last; one that may not keeps
    its own first pool, down or not."""
    fleet = tuple(p.name for p in ordered(pools))
    order = tuple(n for n in tier.order if n in fleet) or fleet
    if not order:
        return ()
    if not tier.failover and not tier.overflow:
        return order[:1]
    if tier.failover and serving in fleet:
        down = set(fleet[: fleet.index(serving)])
        if down & set(order):
            order = (*(n for n in order if n not in down), *(n for n in order if n in down))
    return order


def may_enter(pool: PoolSpec, serving: str | None, failing_over: bool) -> bool:
    """Whether a request moving on from an earlier pool may go into `pool`: a passive
    pool takes traffic only by failover, unless it is the one serving the model now."""
    return not pool.passive or failing_over or pool.name == serving


def may_leave(tier: TierPools, health: PoolHealth | None) -> bool:
    """Whether a request of `tier` may go on to the next pool after this one."""
    if health is None or not health.healthy:
        return tier.failover
    if health.saturated:
        return tier.overflow
    return False
