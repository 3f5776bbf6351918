"""TokenBucket: grants, waits, debts and refunds, with time passed in."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from seawall.policy.token_bucket import TokenBucket


def test_full_bucket_grants_burst_then_says_how_long_to_wait() -> None:
    bucket = TokenBucket.full(capacity=10, refill_per_s=2, now=100.0)
    assert bucket.try_take(10, now=100.0) == 0.0
    assert bucket.level(100.0) == 0.0
    # Nothing left: 3 tokens at 2/s are 1.5 s away, and nothing was removed by asking.
    assert bucket.try_take(3, now=100.0) == 1.5
    assert bucket.try_take(3, now=100.0) == 1.5
    assert bucket.try_take(3, now=101.5) == 0.0


def test_refill_is_capped_at_capacity() -> None:
    bucket = TokenBucket.full(capacity=5, refill_per_s=1, now=0.0)
    bucket.try_take(5, now=0.0)
    assert bucket.level(1000.0) == 5.0


def test_amount_over_capacity_never_fits() -> None:
    bucket = TokenBucket.full(capacity=5, refill_per_s=1, now=0.0)
    assert bucket.try_take(6, now=0.0) == math.inf
    assert bucket.level(0.0) == 5.0


def test_no_refill_means_an_infinite_wait() -> None:
    bucket = TokenBucket.full(capacity=1, refill_per_s=0, now=0.0)
    assert bucket.try_take(1, now=0.0) == 0.0
    assert bucket.try_take(1, now=1e9) == math.inf


def test_charge_creates_a_debt_that_delays_the_next_grant() -> None:
    bucket = TokenBucket.full(capacity=100, refill_per_s=10, now=0.0)
    assert bucket.try_take(50, now=0.0) == 0.0
    bucket.charge(150, now=0.0)  # real usage was far above the estimate
    assert bucket.level(0.0) == -100.0
    # 1 token needs the debt repaid first: 101 tokens at 10/s.
    assert bucket.try_take(1, now=0.0) == 10.1
    assert bucket.try_take(1, now=10.1) == 0.0


def test_refund_is_capped_at_capacity() -> None:
    bucket = TokenBucket.full(capacity=10, refill_per_s=1, now=0.0)
    bucket.try_take(4, now=0.0)
    bucket.refund(100, now=0.0)
    assert bucket.level(0.0) == 10.0


def test_clock_stepping_back_refills_nothing_and_loses_nothing() -> None:
    bucket = TokenBucket.full(capacity=10, refill_per_s=1, now=50.0)
    bucket.try_take(10, now=50.0)
    assert bucket.try_take(1, now=40.0) == 1.0
    assert bucket.level(51.0) == 1.0


@given(
    capacity=st.floats(1, 1000),
    refill_per_s=st.floats(0.01, 100),
    steps=st.lists(st.tuples(st.floats(0, 10), st.floats(0, 1000)), max_size=50),
)
def test_granted_total_never_exceeds_capacity_plus_refill(
    capacity: float, refill_per_s: float, steps: list[tuple[float, float]]
) -> None:
    bucket = TokenBucket.full(capacity, refill_per_s, now=0.0)
    now = 0.0
    granted = 0.0
    for dt, amount in steps:
        now += dt
        wait_s = bucket.try_take(amount, now)
        if wait_s == 0.0:
            granted += amount
        elif amount <= capacity:
            # The promised wait is honest: after it, the same request is granted.
            probe = TokenBucket(
                bucket.capacity, bucket.refill_per_s, bucket.tokens, bucket.updated_at
            )
            assert probe.try_take(amount, now + wait_s * (1 + 1e-9) + 1e-9) == 0.0
        assert -1e-6 <= bucket.level(now) <= capacity
    assert granted <= capacity + refill_per_s * now + 1e-6
