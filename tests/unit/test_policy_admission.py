"""Admission: per-replica saturation reasons and the fleet-level queue/shed decision."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from seawall.fleet.view import EngineLoad
from seawall.policy.admission import (
    AdmissionThresholds,
    Queue,
    Shed,
    on_fleet_saturated,
    replica_saturated,
)

T = AdmissionThresholds(kv_usage_max=0.9, waiting_max=5, preemption_rate_max_per_s=2.0)


def fresh(**kw: float) -> EngineLoad:
    return EngineLoad(scraped_at=100.0, **kw)


def test_healthy_replica_admits() -> None:
    load = fresh(running=3, waiting=5, kv_usage=0.9)  # equal to the maxima is allowed
    assert replica_saturated(load, inflight=3, preemption_rate_per_s=2.0, now=101.0, t=T) is None


def test_missing_or_old_metrics_are_stale() -> None:
    assert replica_saturated(None, 0, None, now=100.0, t=T) == "metrics stale"
    old = fresh(kv_usage=0.1)
    assert replica_saturated(old, 0, None, now=105.0, t=T) is None
    assert replica_saturated(old, 0, None, now=105.1, t=T) == "metrics stale"


def test_each_threshold_names_itself() -> None:
    cases = [
        (fresh(kv_usage=0.95), 0, None, "kv cache 95% used, over 90% (kv_usage_max)"),
        (fresh(waiting=6), 0, None, "6 requests waiting, over 5 (waiting_max)"),
        (fresh(), 0, 3.5, "3.5 preemptions/s, over 2 (preemption_rate_max_per_s)"),
    ]
    for load, inflight, rate, reason in cases:
        assert replica_saturated(load, inflight, rate, now=100.0, t=T) == reason


def test_inflight_limit_applies_only_when_set_and_needs_no_engine_gauges() -> None:
    limited = AdmissionThresholds(inflight_max=8)
    load = fresh()  # an engine that exports none of the gauges
    assert replica_saturated(load, 7, None, now=100.0, t=limited) is None
    assert replica_saturated(load, 8, None, now=100.0, t=limited) == (
        "8 sequences in flight, at the limit of 8 (inflight_max)"
    )
    assert replica_saturated(load, 10_000, None, now=100.0, t=T) is None


def test_top_tier_queues_lower_tiers_are_shed_first() -> None:
    # Tiers 0 and 1 may queue; tier 1 gets only the first half of the queue.
    def decide(priority: int, queue_len: int) -> Queue | Shed:
        return on_fleet_saturated(
            priority, queue_len, queue_max=10, lowest_priority_to_queue=1, completions_per_s=2.0
        )

    assert isinstance(decide(0, 0), Queue)
    assert isinstance(decide(1, 4), Queue)
    shed_one = decide(1, 5)
    assert isinstance(shed_one, Shed) and "share of the queue" in shed_one.reason
    assert isinstance(decide(0, 9), Queue)
    full = decide(0, 10)
    assert isinstance(full, Shed) and "queue full" in full.reason
    never = decide(2, 0)
    assert isinstance(never, Shed) and "not queued" in never.reason


def test_retry_after_follows_the_completion_rate() -> None:
    def shed_after(queue_len: int, rate: float) -> float:
        d = on_fleet_saturated(5, queue_len, 10, 1, completions_per_s=rate)
        assert isinstance(d, Shed)
        return d.retry_after_s

    assert shed_after(9, 2.0) == 5.0  # 10 requests at 2/s
    assert shed_after(9, 0.5) == 20.0
    assert shed_after(0, 100.0) == 1.0  # floor
    assert shed_after(9, 0.01) == 60.0  # ceiling
    assert shed_after(0, 0.0) == 60.0  # nothing completing: back off fully
    assert shed_after(0, math.nan) == 60.0
    assert shed_after(2, 2.0) == 2.0  # 1.5 s rounds up to whole seconds


def test_queue_reports_the_expected_wait() -> None:
    d = on_fleet_saturated(0, 3, 10, 0, completions_per_s=4.0)
    assert d == Queue(expected_wait_s=1.0)


@given(
    p=st.integers(0, 5),
    lowest=st.integers(-1, 5),
    queue_len=st.integers(0, 50),
    queue_max=st.integers(0, 50),
    rate=st.floats(0, 1000),
)
def test_a_more_important_tier_is_never_treated_worse(
    p: int, lowest: int, queue_len: int, queue_max: int, rate: float
) -> None:
    lower = on_fleet_saturated(p + 1, queue_len, queue_max, lowest, rate)
    higher = on_fleet_saturated(p, queue_len, queue_max, lowest, rate)
    if isinstance(lower, Queue):
        assert isinstance(higher, Queue)
    for d in (lower, higher):
        if isinstance(d, Shed):
            assert 1.0 <= d.retry_after_s <= 60.0
        else:
            assert queue_len < queue_max


@given(queue_len=st.integers(0, 100), rate=st.floats(0.001, 1000), more=st.integers(0, 100))
def test_a_longer_queue_never_shortens_retry_after(queue_len: int, rate: float, more: int) -> None:
    a = on_fleet_saturated(9, queue_len, 10, 0, rate)
    b = on_fleet_saturated(9, queue_len + more, 10, 0, rate)
    assert isinstance(a, Shed) and isinstance(b, Shed)
    assert b.retry_after_s >= a.retry_after_s


def test_a_slot_is_free_only_while_the_engine_runs_fewer_than_it_has() -> None:
    from seawall.policy.admission import slot_free

    assert slot_free(EngineLoad(running=3, slots=4), 0)
    assert not slot_free(EngineLoad(running=4, slots=4), 0)
    # The gateway's own sequences there count even before a scrape shows them.
    assert not slot_free(EngineLoad(running=1, slots=4), 4)
    # An engine that does not say how many it has gets the benefit of the doubt.
    assert slot_free(EngineLoad(running=400), 0) and slot_free(None, 10)
