"""Cordon after k restarts within the window, and not before."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seawall.policy.ledger import RestartRecord, failure_domain, names_a_node, should_cordon


def test_third_restart_in_ten_minutes_cordons() -> None:
    history = [1000.0, 1200.0]
    assert not should_cordon(history, now=1300.0, k=3, window_s=600)
    assert should_cordon([*history, 1300.0], now=1300.0, k=3, window_s=600)


def test_old_restarts_age_out() -> None:
    history = [0.0, 100.0, 700.0]
    assert should_cordon(history, now=700.0, k=3, window_s=700)  # boundary included
    assert not should_cordon(history, now=700.1, k=3, window_s=700)


def test_restarts_after_now_still_count() -> None:
    assert should_cordon([10.0, 20.0], now=5.0, k=2, window_s=60)


def test_k_must_be_positive() -> None:
    with pytest.raises(ValueError, match="k must be"):
        should_cordon([], now=0.0, k=0, window_s=60)


def test_record_is_a_plain_value() -> None:
    a = RestartRecord(node="gpu-3", replica_id="r7", reason="stuck", at_wall=1.7e9)
    assert a == RestartRecord("gpu-3", "r7", "stuck", 1.7e9)


@given(
    # Whole seconds, so the reference count below is free of float rounding.
    times=st.lists(st.integers(0, 10_000).map(float), max_size=30),
    now=st.integers(0, 10_000).map(float),
    k=st.integers(1, 10),
    window_s=st.integers(0, 5_000).map(float),
)
def test_more_restarts_or_a_wider_window_never_uncordon(
    times: list[float], now: float, k: int, window_s: float
) -> None:
    if should_cordon(times, now, k, window_s):
        assert should_cordon([*times, now], now, k, window_s)
        assert should_cordon(times, now, k, window_s * 2)
    assert should_cordon(times, now, k, window_s) == (
        sum(1 for t in times if now - window_s <= t) >= k
    )


def test_a_replica_without_a_node_is_its_own_failure_domain() -> None:
    assert failure_domain("gpu-3", "r0") == "gpu-3"
    assert failure_domain(None, "r0") == "replica:r0"
    assert failure_domain("", "r0") == "replica:r0"
    assert failure_domain(None, "r0") != failure_domain(None, "r1")
    assert names_a_node("gpu-3") and not names_a_node("replica:r0")


def test_restarts_before_the_last_uncordon_no_longer_count() -> None:
    history = [100.0, 200.0, 300.0]
    assert should_cordon(history, now=300.0, k=3, window_s=3600)
    # The operator uncordoned at 350: the next restart is the first that counts again.
    assert not should_cordon([*history, 400.0], now=400.0, k=3, window_s=3600, uncordoned_at=350)
    assert should_cordon(
        [*history, 400.0, 500.0, 600.0], now=600.0, k=3, window_s=3600, uncordoned_at=350
    )
