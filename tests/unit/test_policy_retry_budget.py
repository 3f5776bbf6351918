"""RetryBudget: retries are capped by successes, with a small time-based reserve."""

from __future__ import annotations

import pytest
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


def test_earned_tokens_expire_after_the_ttl() -> None:
    # Issue 12 bug 4: a long healthy stretch must not bank an allowance that a sudden
    # failure spends all at once. 10,000 successes over 100 s, then trouble at 200 s:
    # only the reserve is left, because every earned token has aged out.
    budget = RetryBudget(ratio=0.1, min_per_s=1.0, reserve_window_s=10.0, now=0.0, ttl_s=10.0)
    for i in range(10_000):
        budget.deposit(now=i / 100)
    assert budget.level(100.0) > 10.0  # the last 10 s of successes still count
    spent = sum(budget.try_withdraw(now=200.0) for _ in range(1000))
    assert spent == 10  # the reserve's capacity, and nothing banked


def test_recent_successes_still_pay_for_retries() -> None:
    budget = RetryBudget(ratio=0.1, min_per_s=0.0, now=0.0, ttl_s=10.0)
    for _ in range(50):
        budget.deposit(now=100.0)
    assert sum(budget.try_withdraw(now=105.0) for _ in range(100)) == 5
    for _ in range(50):
        budget.deposit(now=105.0)
    # The deposits of 105 s are still there at 114 s, gone by 115 s.
    assert budget.level(114.0) == pytest.approx(5.0)
    assert budget.level(115.0) == 0.0


def test_withdrawals_take_the_oldest_tokens_first() -> None:
    budget = RetryBudget(ratio=1.0, min_per_s=0.0, now=0.0, ttl_s=10.0)
    budget.deposit(now=0.0)
    budget.deposit(now=5.0)
    assert budget.try_withdraw(now=6.0)
    # The one left is the 5 s deposit, which lives until 15 s.
    assert budget.level(12.0) == 1.0
    assert budget.level(15.0) == 0.0


def test_max_balance_and_ttl_come_from_the_config() -> None:
    from seawall.config import parse_config

    retry = parse_config({"retry": {"budget_max_balance": 7, "budget_ttl_s": 30}}).retry
    assert (retry.budget_max_balance, retry.budget_ttl_s) == (7, 30)
