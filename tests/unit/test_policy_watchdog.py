"""Progress watchdog: in-flight work without progress for the window means stuck."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from seawall.policy.watchdog import ProgressWatchdog


def test_engine_view_detects_a_hang_with_running_requests() -> None:
    dog = ProgressWatchdog(window_s=60)
    dog.observe_engine(running=4, generation_tokens_total=1000, now=0.0)
    dog.observe_engine(running=4, generation_tokens_total=1500, now=10.0)  # progressing
    for t in range(20, 70, 10):
        dog.observe_engine(running=4, generation_tokens_total=1500, now=float(t))
        assert dog.stuck(float(t)) is None
    dog.observe_engine(running=4, generation_tokens_total=1500, now=70.0)
    reason = dog.stuck(70.0)
    assert reason is not None
    assert reason.startswith("engine reports 4 running")
    assert "60s" in reason


def test_gateway_view_detects_a_hang_the_engine_gauge_hides() -> None:
    # The engine says nothing is running and its counter is flat, but the gateway holds
    # open streams to it that relay nothing: only the gateway view can see this hang.
    dog = ProgressWatchdog(window_s=60)
    dog.observe_engine(running=0, generation_tokens_total=500, now=0.0)
    dog.observe_gateway(streams_in_flight=3, chunks_relayed_total=42, now=0.0)
    for t in range(10, 60, 10):
        dog.observe_engine(running=0, generation_tokens_total=500, now=float(t))
        dog.observe_gateway(streams_in_flight=3, chunks_relayed_total=42, now=float(t))
    assert dog.stuck(59.0) is None
    reason = dog.stuck(60.0)
    assert reason is not None
    assert reason.startswith("gateway has 3 streams in flight")
    assert "engine reports 0 running" in reason


def test_relayed_chunks_count_as_progress_even_if_the_engine_counter_is_flat() -> None:
    dog = ProgressWatchdog(window_s=60)
    for t in range(0, 200, 10):
        dog.observe_engine(running=2, generation_tokens_total=100, now=float(t))
        dog.observe_gateway(streams_in_flight=2, chunks_relayed_total=t, now=float(t))
        assert dog.stuck(float(t)) is None


def test_engine_tokens_count_as_progress_without_gateway_streams() -> None:
    dog = ProgressWatchdog(window_s=60)
    for t in range(0, 200, 10):
        dog.observe_engine(running=2, generation_tokens_total=float(t), now=float(t))
        dog.observe_gateway(streams_in_flight=0, chunks_relayed_total=0, now=float(t))
        assert dog.stuck(float(t)) is None


def test_idle_replica_is_never_stuck() -> None:
    dog = ProgressWatchdog(window_s=60)
    dog.observe_engine(running=0, generation_tokens_total=100, now=0.0)
    dog.observe_gateway(streams_in_flight=0, chunks_relayed_total=7, now=0.0)
    assert dog.stuck(10_000.0) is None


def test_the_window_starts_when_work_arrives_not_at_the_last_idle_scrape() -> None:
    dog = ProgressWatchdog(window_s=60)
    dog.observe_gateway(streams_in_flight=0, chunks_relayed_total=0, now=0.0)
    dog.observe_gateway(streams_in_flight=1, chunks_relayed_total=0, now=50.0)
    assert dog.stuck(100.0) is None
    assert dog.stuck(110.0) is not None


def test_counter_reset_is_progress() -> None:
    dog = ProgressWatchdog(window_s=60)
    dog.observe_engine(running=1, generation_tokens_total=9000, now=0.0)
    dog.observe_engine(running=1, generation_tokens_total=9000, now=50.0)
    dog.observe_engine(running=1, generation_tokens_total=3, now=55.0)  # process restarted
    assert dog.stuck(100.0) is None
    assert dog.stuck(115.0) is not None


def test_a_stale_engine_scrape_is_not_evidence_of_work() -> None:
    dog = ProgressWatchdog(window_s=60)
    dog.observe_engine(running=5, generation_tokens_total=10, now=0.0)
    assert dog.stuck(60.0) is not None
    # No scrape since: the old "running 5" no longer counts.
    assert dog.stuck(61.0) is None
    # A fresh scrape starts a new stretch instead of reaching back across the gap.
    dog.observe_engine(running=5, generation_tokens_total=10, now=200.0)
    assert dog.stuck(200.0) is None
    assert dog.stuck(260.0) is not None


def test_missing_engine_metrics_leave_the_gateway_view_working() -> None:
    dog = ProgressWatchdog(window_s=30)
    dog.observe_engine(running=None, generation_tokens_total=None, now=0.0)
    dog.observe_gateway(streams_in_flight=1, chunks_relayed_total=5, now=0.0)
    reason = dog.stuck(30.0)
    assert reason is not None
    assert "no running gauge" in reason and "no token counter" in reason


@given(
    steps=st.lists(
        st.tuples(st.floats(0.1, 20), st.integers(0, 3), st.booleans()), min_size=1, max_size=60
    )
)
def test_never_stuck_while_chunks_keep_flowing_within_the_window(
    steps: list[tuple[float, int, bool]],
) -> None:
    dog = ProgressWatchdog(window_s=30)
    now = 0.0
    # A chunk was relayed since the last look, every time.
    for chunks, (dt, streams, engine_running) in enumerate(steps, start=1):
        now += dt
        dog.observe_engine(running=4 if engine_running else 0, generation_tokens_total=1, now=now)
        dog.observe_gateway(streams_in_flight=streams, chunks_relayed_total=chunks, now=now)
        assert dog.stuck(now) is None
