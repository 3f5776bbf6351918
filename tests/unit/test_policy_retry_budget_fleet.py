"""The retry budget's reserve as one instance's share of the fleet's (issue 15): with N
gateway instances each holds 1/N of it, re-sized as N changes, so that the fleet's
retries and hedges are bounded by one reserve, not N."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from seawall.policy.retry_budget import RetryBudget


def _budget(now: float = 0.0, full: bool = True) -> RetryBudget:
    return RetryBudget(ratio=0.1, min_per_s=1.0, reserve_window_s=9.0, now=now, reserve_full=full)


def test_one_of_three_instances_holds_a_third_of_the_reserve_and_its_refill() -> None:
    b = _budget()
    b.share(3, now=0.0)
    assert b.reserve_capacity == 3.0
    assert sum(b.try_withdraw(now=0.0) for _ in range(10)) == 3
    assert not b.try_withdraw(now=2.9)  # a third of a token per second
    assert b.try_withdraw(now=3.0)
    assert not b.try_withdraw(now=3.0)


def test_a_growing_fleet_clamps_the_level_and_a_shrinking_one_refills_into_its_room() -> None:
    b = _budget()
    assert b.level(0.0) == 9.0
    b.share(3, now=0.0)
    assert b.level(0.0) == 3.0  # no instance keeps more than its share
    b.share(1, now=0.0)  # the others left: room for 9 again, but no burst handed over
    assert b.level(0.0) == 3.0
    assert b.level(6.0) == 9.0  # refilled at the whole rate
    b.share(3, now=6.0)
    b.share(3, now=6.0)  # the same count again changes nothing
    assert b.level(6.0) == 3.0


def test_a_resize_refills_up_to_now_at_the_old_rate_first() -> None:
    b = _budget()
    b.share(3, now=0.0)
    assert sum(b.try_withdraw(now=0.0) for _ in range(3)) == 3
    b.share(1, now=3.0)  # 3 s at a third of a token per second: one token
    assert abs(b.level(3.0) - 1.0) < 1e-9
    assert abs(b.level(4.0) - 2.0) < 1e-9  # then the whole rate


def test_an_instance_joining_a_fleet_starts_with_an_empty_reserve() -> None:
    b = _budget(full=False)
    assert not b.try_withdraw(now=0.0)
    b.share(3, now=0.0)
    assert b.try_withdraw(now=3.0)  # a third of a token per second


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(
        st.tuples(
            st.sampled_from(["deposit", "withdraw", "withdraw", "withdraw", "join", "tick"]),
            st.integers(0, 3),
            st.floats(0.0, 3.0),
        ),
        max_size=300,
    )
)
def test_a_fleet_withdraws_at_most_ratio_times_its_successes_plus_one_reserve(
    events: list[tuple[str, int, float]],
) -> None:
    """Instances join (empty) and leave; those alive agree on how many they are. Over the
    run, the fleet's withdrawals stay within ratio x deposits + one reserve + the one
    reserve's refill over the time elapsed."""
    ratio, min_per_s, window_s = 0.1, 1.0, 9.0
    now = 0.0
    fleet = [RetryBudget(ratio, min_per_s, window_s, now=now)]
    deposits = withdrawals = 0
    for kind, which, dt in events:
        if kind == "tick":
            now += dt
        elif kind == "deposit":
            fleet[which % len(fleet)].deposit(now)
            deposits += 1
        elif kind == "withdraw":
            withdrawals += fleet[which % len(fleet)].try_withdraw(now)
        elif kind == "join" and which and len(fleet) < 6:
            fleet.append(RetryBudget(ratio, min_per_s, window_s, now=now, reserve_full=False))
        elif kind == "join" and len(fleet) > 1:  # `which` 0: one leaves instead
            fleet.pop(len(fleet) // 2)
        for b in fleet:
            b.share(len(fleet), now)
        bound = ratio * deposits + min_per_s * window_s + min_per_s * now
        assert withdrawals <= bound + 1e-6 * (1 + withdrawals)
