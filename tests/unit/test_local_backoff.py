"""The local supervisor's pure parts: crash-loop backoff and command templates."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seawall.actuate.local import BackoffPolicy, plan_restart, render_command

POLICY = BackoffPolicy(initial_s=1.0, max_s=60.0, reset_after_s=120.0)


def test_a_crash_loop_waits_one_second_then_doubles_up_to_a_minute() -> None:
    streak, delays = 0, []
    for _ in range(9):
        plan = plan_restart(POLICY, streak, up_for_s=0.5)
        streak = plan.crash_streak
        delays.append(plan.delay_s)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    assert streak == 9


def test_a_replica_that_stayed_up_long_enough_is_not_in_a_crash_loop() -> None:
    plan = plan_restart(POLICY, crash_streak=7, up_for_s=120.0)
    assert plan == plan_restart(POLICY, crash_streak=0, up_for_s=0.0)
    assert plan.delay_s == 1.0 and plan.crash_streak == 1


def test_a_replica_that_died_just_before_the_reset_keeps_its_streak() -> None:
    assert plan_restart(POLICY, crash_streak=3, up_for_s=119.9).delay_s == 8.0


@given(
    streak=st.integers(min_value=0, max_value=10_000),
    up_for_s=st.floats(min_value=0, max_value=1e6),
)
def test_backoff_stays_between_initial_and_max_and_never_shrinks_in_a_loop(
    streak: int, up_for_s: float
) -> None:
    plan = plan_restart(POLICY, streak, up_for_s)
    assert POLICY.initial_s <= plan.delay_s <= POLICY.max_s
    if up_for_s < POLICY.reset_after_s:
        assert plan.delay_s >= plan_restart(POLICY, max(streak - 1, 0), up_for_s).delay_s


def test_command_template_fills_port_model_replica_and_index() -> None:
    argv = render_command(
        [
            "vllm",
            "serve",
            "{model}",
            "--port",
            "{port}",
            "--served-model-name",
            "{replica}-{index}",
        ],
        port=8001,
        model="m/x",
        replica="r2",
        index=2,
    )
    assert argv == ["vllm", "serve", "m/x", "--port", "8001", "--served-model-name", "r2-2"]


def test_command_template_error_names_the_placeholder_and_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"\{gpu\}.*\{port\}, \{model\}, \{replica\}, \{index\}"):
        render_command(["engine", "--gpu", "{gpu}"], port=1, model="m", replica="r", index=0)


def test_literal_braces_survive_the_template() -> None:
    argv = render_command(["e", '{{"a": {port}}}'], port=5, model="m", replica="r", index=0)
    assert argv == ["e", '{"a": 5}']
