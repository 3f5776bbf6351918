"""RetryBudget: retries are capped by successes, with a small time-based reserve."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from seawall.policy.retry_budget import RetryBudget


def test_idle_gateway_can_retry_from_the_reserve_only() -> None:
    budget = RetryBudget(ratio=0.1, min_per_s=1.0, reserve_window_s=10.0, now=0.0)
    assert sum(budget.try_withdraw(now=0.0) for _ in range(20)) == 10
    assert not budget.try_withdraw(now=0.0)
    # The reserve refills at min_per_s.
    assert budget.try_withdraw(now=1.0)
    assert not budget.try_withdraw(now=1.0)


def test_ten_successes_buy_one_retry() -> None:
    budget = RetryBudget(ratio=0.1, min_per_s=0.0, now=0.0)
    assert not budget.try_withdraw(now=0.0)
    for _ in range(10):
        budget.deposit(now=0.0)
    assert budget.try_withdraw(now=0.0)
    assert not budget.try_withdraw(now=0.0)


def test_failing_fleet_gets_at_most_ratio_extra_load() -> None:
    # 1000 requests, 100 succeed, all 900 failures want a retry: only ~10 % of the
    # successes (plus the reserve) are allowed through.
    budget = RetryBudget(ratio=0.1, min_per_s=1.0, reserve_window_s=10.0, now=0.0)
    retries = 0
    for i in range(1000):
        if i % 10 == 0:
            budget.deposit(now=0.0)
        elif budget.try_withdraw(now=0.0):
            retries += 1
    assert retries == 10 + 10  # 100 * 0.1 earned + 10 reserve


def test_earned_balance_is_capped() -> None:
    budget = RetryBudget(ratio=1.0, min_per_s=0.0, max_balance=5.0, now=0.0)
    for _ in range(100):
        budget.deposit(now=0.0)
    assert budget.level(0.0) == 5.0
    assert sum(budget.try_withdraw(now=0.0) for _ in range(100)) == 5


def test_level_counts_earned_and_reserve() -> None:
    budget = RetryBudget(ratio=0.5, min_per_s=2.0, reserve_window_s=3.0, now=0.0)
    assert budget.level(0.0) == 6.0
    budget.deposit(now=0.0)
    assert budget.level(0.0) == 6.5


@given(
    ratio=st.floats(0.0, 1.0),
    min_per_s=st.floats(0.0, 5.0),
    reserve_window_s=st.floats(0.0, 30.0),
    max_balance=st.floats(0.0, 200.0),
    events=st.lists(st.tuples(st.booleans(), st.floats(0.0, 5.0)), max_size=300),
)
def test_withdrawals_are_bounded_by_deposits_reserve_and_time(
    ratio: float,
    min_per_s: float,
    reserve_window_s: float,
    max_balance: float,
    events: list[tuple[bool, float]],
) -> None:
    budget = RetryBudget(ratio, min_per_s, reserve_window_s, max_balance, now=0.0)
    now = 0.0
    deposits = withdrawals = 0
    for is_success, dt in events:
        now += dt
        if is_success:
            budget.deposit(now)
            deposits += 1
        elif budget.try_withdraw(now):
            withdrawals += 1
        assert budget.level(now) >= 0.0
    bound = ratio * deposits + min_per_s * reserve_window_s + min_per_s * now
    assert withdrawals <= bound + 1e-9 * (withdrawals + 1) + 1e-9 * deposits
