"""Health score: documented values, bounds, and monotonicity (worse never scores higher)."""

from __future__ import annotations

import dataclasses
import math

from hypothesis import given
from hypothesis import strategies as st

from seawall.policy.score import ScoreInputs, score

_OPT_RATIO = st.none() | st.floats(0.0, 1.0)
_OPT_POS = st.none() | st.floats(0.0, 1e4)

inputs = st.builds(
    ScoreInputs,
    deep_probe_success_ratio=_OPT_RATIO,
    deep_probe_latency_s=_OPT_POS,
    fleet_median_deep_probe_latency_s=_OPT_POS,
    kv_usage=_OPT_RATIO,
    waiting=_OPT_POS,
    preemption_rate_per_s=_OPT_POS,
    ttft_s=_OPT_POS,
    fleet_median_ttft_s=_OPT_POS,
    itl_s=_OPT_POS,
    fleet_median_itl_s=_OPT_POS,
    error_rate=_OPT_RATIO,
    hardware_fault=st.booleans(),
)

# For each input, what "worse" means: larger, except the probe success ratio.
_WORSE_IS_HIGHER = [
    "deep_probe_latency_s",
    "kv_usage",
    "waiting",
    "preemption_rate_per_s",
    "ttft_s",
    "itl_s",
    "error_rate",
]


def test_nothing_known_is_a_perfect_score() -> None:
    b = score(ScoreInputs())
    assert b.total == 1.0
    assert set(b.factors().values()) == {1.0}


def test_documented_factor_values() -> None:
    b = score(
        ScoreInputs(
            deep_probe_success_ratio=0.5,
            deep_probe_latency_s=3.0,
            fleet_median_deep_probe_latency_s=1.0,  # tolerated up to 1.5 s: factor 0.5
            kv_usage=0.9,  # halfway from 0.8 to 1.0: factor 0.75
            waiting=10,  # waiting_half: factor 0.5
            preemption_rate_per_s=1.0,  # half rate: factor 0.5
            ttft_s=1.0,
            fleet_median_ttft_s=1.0,  # at the median: no penalty
            itl_s=0.06,
            fleet_median_itl_s=0.04,  # exactly at the tolerance: no penalty
            error_rate=0.2,
        )
    )
    assert b.probe_success == 0.5
    assert b.probe_latency == 0.5
    assert math.isclose(b.kv, 0.75)
    assert b.waiting == 0.5
    assert b.preemption == 0.5
    assert b.ttft == 1.0
    assert math.isclose(b.itl, 1.0)
    assert b.errors == 0.8
    assert b.hardware == 1.0
    assert math.isclose(b.total, 0.5 * 0.5 * 0.75 * 0.5 * 0.5 * 0.8)


def test_hardware_fault_sinks_the_score() -> None:
    assert score(ScoreInputs(hardware_fault=True)).total == 0.01


def test_broken_measurements_count_as_worst_not_healthy() -> None:
    nan = float("nan")
    b = score(ScoreInputs(waiting=nan, preemption_rate_per_s=nan, error_rate=nan, kv_usage=nan))
    assert b.waiting == b.preemption == b.errors == 0.05
    assert b.kv == 0.5


@given(parts=inputs)
def test_score_is_in_zero_one(parts: ScoreInputs) -> None:
    b = score(parts)
    assert 0.0 < b.total <= 1.0
    assert all(0.0 < f <= 1.0 for f in b.factors().values())
    assert math.isclose(b.total, math.prod(b.factors().values()))


@given(parts=inputs, field=st.sampled_from(_WORSE_IS_HIGHER), delta=st.floats(0.0, 1e4))
def test_a_higher_bad_input_never_raises_the_score(
    parts: ScoreInputs, field: str, delta: float
) -> None:
    value = getattr(parts, field)
    if value is None:
        return
    worse_value = value + delta
    if field in ("kv_usage", "error_rate"):
        worse_value = min(1.0, worse_value)
    worse = dataclasses.replace(parts, **{field: worse_value})
    assert score(worse).total <= score(parts).total


@given(parts=inputs, drop=st.floats(0.0, 1.0))
def test_fewer_probe_successes_or_a_fault_never_raise_the_score(
    parts: ScoreInputs, drop: float
) -> None:
    if parts.deep_probe_success_ratio is not None:
        worse = dataclasses.replace(
            parts, deep_probe_success_ratio=max(0.0, parts.deep_probe_success_ratio - drop)
        )
        assert score(worse).total <= score(parts).total
    faulty = dataclasses.replace(parts, hardware_fault=True)
    assert score(faulty).total <= score(parts).total
