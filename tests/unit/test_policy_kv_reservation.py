"""Admission by reserved KV blocks: in-flight prompt + max_tokens (the incoming request
included) against the cache's blocks."""

from hypothesis import given
from hypothesis import strategies as st

from seawall.policy.admission import kv_reservation_full


def test_a_request_is_admitted_only_while_everything_would_fit() -> None:
    # 99 usable blocks; five requests of 19 blocks fit (95), a sixth would not (114).
    assert kv_reservation_full(5 * 19, 99, 1.0) is None
    reason = kv_reservation_full(6 * 19, 99, 1.0)
    assert reason is not None and "kv_reserve_max" in reason
    assert kv_reservation_full(99, 99, 1.0) is None  # exactly full still fits


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
