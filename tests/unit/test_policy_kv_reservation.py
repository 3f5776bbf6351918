"""Admission by reserved KV tokens: in-flight prompt + max_tokens against the cache size."""

from hypothesis import given
from hypothesis import strategies as st

from seawall.policy.admission import kv_reservation_full


def test_full_when_reservations_reach_the_cache() -> None:
    assert kv_reservation_full(1000, 1520, 1.0) is None
    reason = kv_reservation_full(1520, 1520, 1.0)
    assert reason is not None and "kv_reserve_max" in reason


def test_overcommit_ratio_allows_more_than_the_cache() -> None:
    assert kv_reservation_full(2000, 1520, 1.5) is None
    assert kv_reservation_full(2300, 1520, 1.5) is not None


def test_unknown_capacity_or_disabled_never_saturates() -> None:
    assert kv_reservation_full(10**9, None, 1.0) is None
    assert kv_reservation_full(10**9, 1520, None) is None


@given(st.floats(0, 1e7), st.floats(1, 1e7), st.floats(0.1, 4), st.floats(0, 1e5))
def test_more_reserved_never_frees_a_full_replica(
    reserved: float, capacity: float, ratio: float, extra: float
) -> None:
    if kv_reservation_full(reserved, capacity, ratio) is not None:
        assert kv_reservation_full(reserved + extra, capacity, ratio) is not None
