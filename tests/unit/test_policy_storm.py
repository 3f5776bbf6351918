"""Preemption storms: sustained rate enters, sustained calm clears, resets are skipped."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from seawall.policy.storm import StormDetector, StormState


def feed(det: StormDetector, rate_per_s: float, start: float, end: float, total: float) -> float:
    """Observe every second from start to end at a constant rate; returns the new total."""
    t = start
    while t < end:
        t += 1.0
        total += rate_per_s
        det.observe(total, t)
    return total


def test_a_sustained_rate_enters_a_storm_only_after_sustain_s() -> None:
    det = StormDetector(rate_threshold_per_s=5, sustain_s=30, clear_s=60)
    assert det.observe(0, 0.0) is StormState.calm
    total = feed(det, 10, 0, 29, 0)
    assert det.state is StormState.calm
    feed(det, 10, 29, 30, total)
    assert det.state is StormState.storm
    assert det.last_rate_per_s == 10


def test_a_short_burst_is_not_a_storm() -> None:
    det = StormDetector(rate_threshold_per_s=5, sustain_s=30, clear_s=60)
    det.observe(0, 0.0)
    total = feed(det, 50, 0, 20, 0)
    total = feed(det, 0, 20, 21, total)  # one quiet second breaks the streak
    feed(det, 50, 21, 50, total)
    assert det.state is StormState.calm


def test_clearing_needs_clear_s_below_half_the_threshold() -> None:
    det = StormDetector(rate_threshold_per_s=10, sustain_s=5, clear_s=20)
    det.observe(0, 0.0)
    total = feed(det, 20, 0, 5, 0)
    assert det.state is StormState.storm
    # Just under the entry threshold but above the clear rate (5/s): still a storm.
    total = feed(det, 8, 5, 100, total)
    assert det.state is StormState.storm
    total = feed(det, 5, 100, 119, total)
    assert det.state is StormState.storm
    feed(det, 5, 119, 120, total)
    assert det.state is StormState.calm


def test_counter_reset_is_skipped_not_read_as_a_negative_or_huge_rate() -> None:
    det = StormDetector(rate_threshold_per_s=5, sustain_s=10, clear_s=10)
    det.observe(1_000_000, 0.0)
    det.observe(3, 1.0)  # restarted engine
    assert det.last_rate_per_s is None
    assert det.state is StormState.calm
    det.observe(4, 2.0)
    assert det.last_rate_per_s == 1.0


def test_reset_during_a_storm_keeps_the_storm() -> None:
    det = StormDetector(rate_threshold_per_s=5, sustain_s=2, clear_s=10)
    det.observe(0, 0.0)
    feed(det, 100, 0, 3, 0)
    assert det.state is StormState.storm
    assert det.observe(0, 4.0) is StormState.storm


def test_repeated_or_older_timestamps_are_ignored() -> None:
    det = StormDetector(rate_threshold_per_s=5, sustain_s=1, clear_s=1)
    det.observe(0, 10.0)
    assert det.observe(1000, 10.0) is StormState.calm
    assert det.observe(1000, 9.0) is StormState.calm
    assert det.last_rate_per_s is None


@given(
    threshold=st.floats(0.5, 50),
    samples=st.lists(st.tuples(st.floats(0.1, 10), st.floats(0, 1000)), max_size=100),
)
def test_never_a_storm_while_the_rate_stays_at_or_under_the_threshold(
    threshold: float, samples: list[tuple[float, float]]
) -> None:
    det = StormDetector(rate_threshold_per_s=threshold, sustain_s=5, clear_s=5)
    now, total = 0.0, 0.0
    det.observe(total, now)
    for dt, preemptions in samples:
        # Cap each interval's count so its rate is at most the threshold.
        total += min(preemptions, threshold * dt * 0.999)
        now += dt
        assert det.observe(total, now) is StormState.calm


@given(
    rate=st.floats(10.1, 1000),
    dts=st.lists(st.floats(0.1, 3), min_size=1, max_size=200),
)
def test_a_rate_above_the_threshold_for_sustain_s_is_always_a_storm(
    rate: float, dts: list[float]
) -> None:
    det = StormDetector(rate_threshold_per_s=10, sustain_s=15, clear_s=5)
    now, total = 0.0, 0.0
    det.observe(total, now)
    for dt in dts:
        now += dt
        total += rate * dt
        state = det.observe(total, now)
        assert (state is StormState.storm) == (now >= 15)
