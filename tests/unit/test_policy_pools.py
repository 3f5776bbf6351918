"""Pools: the serving pool with hysteresis, one request's pool order, and the remote
pool's circuit breaker. Pure: literal times, no sleeping."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from seawall.policy import circuit as cb
from seawall.policy.pools import (
    Change,
    PoolHealth,
    PoolSpec,
    SelectorState,
    TierPools,
    may_leave,
    route_order,
    step,
)

EAST = PoolSpec("east", priority=0)
WEST = PoolSpec("west", priority=1, passive=True)
POOLS = (WEST, EAST)  # out of order on purpose: priority decides
UP, DOWN = PoolHealth(routable=2), PoolHealth(routable=0)


def run(
    timeline: list[tuple[float, PoolHealth, PoolHealth]],
    failover_after_s: float = 2.0,
    failback_after_s: float = 30.0,
) -> tuple[SelectorState, list[tuple[float, Change, str | None, str | None]]]:
    state = SelectorState()
    seen = []
    for now, east, west in timeline:
        state, events = step(
            state, "m", POOLS, {"east": east, "west": west}, now, failover_after_s, failback_after_s
        )
        seen += [(e.at, e.change, e.from_pool, e.to_pool) for e in events]
    return state, seen


def test_the_first_healthy_pool_by_priority_serves() -> None:
    state, events = run([(0.0, UP, UP)])
    assert state.serving == "east" and events == [(0.0, Change.first, None, "east")]


def test_a_single_bad_probe_does_not_move_traffic() -> None:
    # East's only replica is out of routing for one second: no failover event.
    state, events = run([(0.0, UP, UP), (1.0, DOWN, UP), (2.0, UP, UP), (3.0, UP, UP)])
    assert state.serving == "east"
    assert [e for e in events if e[1] is Change.failover] == []


def test_a_pool_down_past_the_hold_fails_over_then_fails_back_only_after_staying_up() -> None:
    timeline = [(0.0, UP, UP), (1.0, DOWN, UP), (2.9, DOWN, UP), (3.0, DOWN, UP)]
    # East back at 10 s, flaps at 25 s, then stays up: failback 30 s after 26 s.
    timeline += [(10.0, UP, UP), (25.0, DOWN, UP), (26.0, UP, UP), (55.9, UP, UP), (56.0, UP, UP)]
    state, events = run(timeline)
    moves = [e for e in events if e[1] is not Change.first]
    assert moves == [
        (3.0, Change.failover, "east", "west"),
        (56.0, Change.failback, "west", "east"),
    ]
    assert state.serving == "east"


def test_no_failover_when_nothing_else_is_up() -> None:
    state, events = run([(0.0, UP, DOWN), (1.0, DOWN, DOWN), (10.0, DOWN, DOWN)])
    assert state.serving == "east" and len(events) == 1


def test_a_request_fails_over_at_once_before_the_selector_moves() -> None:
    gold = TierPools(overflow=True, failover=True)
    assert route_order("east", POOLS, gold) == ("east", "west")
    assert may_leave(gold, DOWN) and may_leave(gold, PoolHealth(2, saturated=True))
    assert not may_leave(gold, UP)  # a pool with room keeps the request


def test_after_a_failover_a_failover_tier_starts_at_the_serving_pool() -> None:
    assert route_order("west", POOLS, TierPools()) == ("west", "east")


def test_a_tier_that_may_not_leave_keeps_its_own_first_pool() -> None:
    free = TierPools(overflow=False, failover=False)
    assert route_order("west", POOLS, free) == ("east",)  # shed rather than sent away
    assert not may_leave(free, DOWN) and not may_leave(free, PoolHealth(2, saturated=True))
    overflow_only = TierPools(overflow=True, failover=False)
    assert route_order("west", POOLS, overflow_only) == ("east", "west")
    assert may_leave(overflow_only, PoolHealth(2, saturated=True))
    assert not may_leave(overflow_only, DOWN)


def test_a_tier_order_of_its_own() -> None:
    own = TierPools(order=("west", "east"), failover=False)
    assert route_order("east", POOLS, own) == ("west", "east")
    # May fail over: its own order still holds while the fleet serves from its first
    # choice's peer (east is up: nothing was failed over from) ...
    assert route_order("east", POOLS, TierPools(order=("west", "east"))) == ("west", "east")
    # ... and a pool the fleet failed over from goes last.
    assert route_order("west", POOLS, TierPools(order=("east", "west"))) == ("west", "east")
    assert route_order("west", POOLS, TierPools()) == ("west", "east")
    assert route_order("east", POOLS, TierPools(order=("nowhere",))) == ("east", "west")


@given(
    st.lists(st.tuples(st.floats(0.0, 5.0), st.booleans(), st.booleans()), min_size=1, max_size=60)
)
def test_the_serving_pool_only_moves_by_the_hysteresis_rules(
    steps: list[tuple[float, bool, bool]],
) -> None:
    state = SelectorState()
    now = 0.0
    for dt, east_up, west_up in steps:
        now += dt
        health = {"east": UP if east_up else DOWN, "west": UP if west_up else DOWN}
        before = state
        state, events = step(state, "m", POOLS, health, now, 2.0, 30.0)
        for e in events:
            if e.change is Change.failover:
                since = before.unhealthy_since.get(e.from_pool or "")
                assert since is not None and now - since >= 2.0
                assert health[e.to_pool or ""].healthy
            if e.change is Change.failback:
                since = state.healthy_since.get(e.to_pool or "")
                assert since is not None and now - since >= 30.0
        assert state.serving in ("east", "west")


def test_the_breaker_opens_after_consecutive_failures_and_lets_one_trial_through() -> None:
    b = cb.Breaker(failures=3, open_s=10.0)
    s = cb.BreakerState()
    for t in (0.0, 1.0):
        s = cb.record(b, s, False, t)
    assert s.circuit is cb.Circuit.closed
    s = cb.record(b, s, True, 1.5)  # a success resets the count
    for t in (2.0, 3.0, 4.0):
        s = cb.record(b, s, False, t)
    assert s.circuit is cb.Circuit.open and not cb.routable(b, s, 13.9)
    assert cb.allows(b, s, 13.9)[0] is False
    ok, s = cb.allows(b, s, 14.0)
    assert ok and s.circuit is cb.Circuit.half_open
    assert cb.allows(b, s, 14.1)[0] is False  # one trial at a time
    s = cb.record(b, s, False, 14.5)  # the trial failed: open again, from now
    assert s.circuit is cb.Circuit.open and not cb.routable(b, s, 24.4)
    ok, s = cb.allows(b, s, 24.5)
    s = cb.record(b, s, True, 24.6)
    assert ok and s == cb.BreakerState()


def test_a_fleet_coming_up_serves_from_its_best_pool_as_soon_as_it_is_up() -> None:
    # The standby region answered its first probe before the primary did: nothing has
    # failed over, so there is nothing to hold; east serves the moment it is healthy.
    state, events = run([(0.0, DOWN, UP), (0.5, UP, UP)])
    assert state.serving == "east"
    assert [e[1] for e in events] == [Change.first, Change.first]
    assert not [e for e in events if e[1] in (Change.failover, Change.failback)]
