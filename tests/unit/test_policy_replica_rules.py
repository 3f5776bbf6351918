"""The fleet monitor's per-replica rules, with literal times: no sockets, no sleeps."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seawall.policy.health import Event, State
from seawall.policy.ledger import RecordKind
from seawall.policy.replica_rules import (
    Fire,
    LoopLag,
    Probe,
    Progress,
    Thresholds,
    Verdict,
    counts_as_failure,
    deep_probe_delay_s,
    fresh,
    judge_deep_probe,
    judge_probe,
    ledger_entry,
    needs_verification,
    on_deep_probe,
    on_liveness,
    on_process_started,
    on_progress_check,
    on_scrape,
    on_verification,
    restarted,
    routing,
    startup_expired,
    still_present,
)
from seawall.policy.storm import StormState

TH = Thresholds(
    startup_allowance_s=60.0,
    liveness_failures_threshold=2,
    deep_probe_failures_threshold=3,
    deep_probe_window=4,
    ready_waiting_threshold=32.0,
)
OK = Probe(ok=True, latency_s=0.01, timeout_s=1.0)
TIMEOUT = Probe(ok=False, error="timeout", latency_s=1.0, timeout_s=1.0)
REFUSED = Probe(ok=False, error="connect", latency_s=0.001, timeout_s=1.0)
IDLE = Progress()
BUSY = Progress(engine_tokens_advanced=True, waiting=2.0)


# ---- verdicts: our own lateness and a busy engine are not failures


def test_a_timeout_while_our_loop_stalled_for_a_quarter_of_it_is_inconclusive() -> None:
    spoiled = replace(TIMEOUT, loop_lag_s=0.25)
    verdict, why = judge_probe(spoiled, TH)
    assert verdict is Verdict.inconclusive
    assert why == "timed out while our event loop stalled 0.25 s of the 1 s timeout"
    assert judge_probe(replace(TIMEOUT, loop_lag_s=0.24), TH)[0] is Verdict.failed


def test_only_a_timeout_can_be_spoiled_by_our_lag() -> None:
    # A refused connection is the replica's answer, however late we read it.
    assert judge_probe(replace(REFUSED, loop_lag_s=5.0), TH) == (Verdict.failed, "connect")
    assert judge_probe(replace(OK, loop_lag_s=5.0), TH) == (Verdict.passed, "")


def test_a_deep_probe_timed_out_in_a_busy_engines_queue_is_inconclusive() -> None:
    verdict, why = judge_deep_probe(TIMEOUT, BUSY, TH)
    assert verdict is Verdict.inconclusive
    assert why == "timeout queued behind a busy engine (tokens still moving, 2 waiting)"
    relayed = Progress(chunks_relayed_advanced=True, waiting=None)
    assert judge_deep_probe(TIMEOUT, relayed, TH)[0] is Verdict.inconclusive
    refused_for_load = replace(TIMEOUT, error="http_429")
    assert judge_deep_probe(refused_for_load, BUSY, TH)[0] is Verdict.inconclusive


@pytest.mark.parametrize(
    ("probe", "progress"),
    [
        (TIMEOUT, IDLE),  # nothing moved: a hang
        (TIMEOUT, Progress(engine_tokens_advanced=True, waiting=0.0)),  # no queue to wait in
        (replace(TIMEOUT, error="http_500"), BUSY),  # an error is not a queue
        (replace(TIMEOUT, error="empty_output"), BUSY),
    ],
)
def test_a_deep_probe_fails_when_the_replica_is_not_visibly_busy(
    probe: Probe, progress: Progress
) -> None:
    assert judge_deep_probe(probe, progress, TH)[0] is Verdict.failed


# ---- liveness


def test_a_starting_replica_fails_quietly_until_its_allowance_runs_out() -> None:
    sig = fresh(now=100.0)
    step = on_liveness(sig, State.starting, REFUSED, now=159.9, th=TH)
    assert step.fire == () and step.signals.liveness_error == "connect"
    step = on_liveness(step.signals, State.starting, REFUSED, now=160.0, th=TH)
    assert step.fire == (Fire(Event.startup_timeout, "not healthy after 60 s (last: connect)"),)
    assert startup_expired(100.0, 60.0, 160.0) and not startup_expired(100.0, 60.0, 159.99)


def test_the_allowance_runs_from_the_real_process_start() -> None:
    ordered = fresh(now=100.0)  # the monitor ordered the restart at 100
    started = on_process_started(ordered, State.starting, now=130.0)  # after a backoff
    assert on_liveness(started, State.starting, REFUSED, now=185.0, th=TH).fire == ()
    # Only a starting replica's clock moves: a ready one's start is long past.
    assert on_process_started(ordered, State.ready, now=130.0) == ordered


def test_a_starting_replica_is_readmitted_by_health_unless_it_must_show_a_token() -> None:
    assert on_liveness(fresh(0.0), State.starting, OK, 1.0, TH).fire == (Fire(Event.health_ok),)
    step = on_liveness(fresh(0.0, verify_with_deep_probe=True), State.starting, OK, 1.0, TH)
    assert step.fire == () and step.verify


def test_liveness_fails_at_the_threshold_and_a_pass_resets_the_streak() -> None:
    sig = fresh(0.0)
    one = on_liveness(sig, State.ready, TIMEOUT, 1.0, TH)
    assert one.fire == () and one.signals.liveness_failures == 1
    passed = on_liveness(one.signals, State.ready, OK, 2.0, TH)
    assert passed.signals.liveness_failures == 0
    two = on_liveness(
        on_liveness(sig, State.ready, TIMEOUT, 1.0, TH).signals, State.ready, TIMEOUT, 2.0, TH
    )
    assert two.fire == (Fire(Event.health_failed, "liveness failed 2 times in a row (timeout)"),)


def test_an_inconclusive_liveness_probe_neither_counts_nor_resets() -> None:
    one = on_liveness(fresh(0.0), State.ready, TIMEOUT, 1.0, TH).signals
    spoiled = on_liveness(one, State.ready, replace(TIMEOUT, loop_lag_s=0.9), 2.0, TH)
    assert spoiled.verdict is Verdict.inconclusive and spoiled.fire == ()
    assert spoiled.signals.liveness_failures == 1
    assert spoiled.signals.liveness_inconclusive == 1
    assert spoiled.signals.liveness_probes == 2
    # A spoiled probe does not end a starting replica's allowance either.
    late = on_liveness(fresh(0.0), State.starting, replace(TIMEOUT, loop_lag_s=0.9), 99.0, TH)
    assert late.fire == ()


def test_a_restarting_replica_is_not_judged_by_liveness() -> None:
    sig = fresh(0.0)
    assert on_liveness(sig, State.restarting, TIMEOUT, 1.0, TH).signals == sig


# ---- deep probes


def test_a_deep_failure_streak_is_reported_once_and_its_recovery_once() -> None:
    sig = fresh(0.0)
    fired = []
    for _ in range(4):
        step = on_deep_probe(sig, TIMEOUT, IDLE, TH)
        sig = step.signals
        fired.extend(step.fire)
    assert fired == [Fire(Event.deep_probe_failed_n, "3 deep probes failed in a row (timeout)")]
    assert sig.deep_reported and sig.deep_streak == 1
    back = on_deep_probe(sig, OK, IDLE, TH)
    assert back.fire == (Fire(Event.deep_probe_ok),)
    assert back.signals.deep_latency_s == 0.01
    assert back.signals.deep_results == (False, False, False, True)  # the window is 4
    assert back.signals.deep_success_ratio == 0.25


def test_queued_deep_probes_never_degrade_a_busy_replica() -> None:
    sig = fresh(0.0)
    for _ in range(10):
        step = on_deep_probe(sig, TIMEOUT, BUSY, TH)
        assert step.fire == () and step.verdict is Verdict.inconclusive
        sig = step.signals
    assert sig.deep_results == () and sig.deep_streak == 0 and sig.deep_inconclusive == 10
    assert sig.deep_success_ratio is None  # nothing against it in the health score


def test_verification_readmits_only_on_a_real_token() -> None:
    sig = fresh(0.0, verify_with_deep_probe=True)
    hung = on_verification(sig, State.starting, TIMEOUT, IDLE, TH)
    assert hung.fire == () and hung.note == "healthy but still not producing tokens (timeout)"
    busy = on_verification(sig, State.starting, TIMEOUT, BUSY, TH)
    assert busy.fire == () and busy.signals.verify_with_deep_probe
    token = on_verification(sig, State.starting, OK, IDLE, TH)
    assert token.fire == (Fire(Event.health_ok, "a deep probe produced a token again"),)
    assert not token.signals.verify_with_deep_probe
    assert on_verification(sig, State.ready, OK, IDLE, TH).fire == ()


# ---- scrapes, progress, re-assertion


def test_storm_and_queue_edges_are_reported_once_each() -> None:
    sig = fresh(0.0)
    step = on_scrape(sig, StormState.calm, StormState.storm, 12.34, 40.0, TH)
    assert step.fire == (
        Fire(Event.storm, "preemptions at 12.3/s"),
        Fire(Event.not_ready, "40 waiting"),
    )
    again = on_scrape(step.signals, StormState.storm, StormState.storm, 12.0, 50.0, TH)
    assert again.fire == ()
    clear = on_scrape(again.signals, StormState.storm, StormState.calm, 0.0, 1.0, TH)
    assert clear.fire == (Fire(Event.storm_cleared), Fire(Event.ready_again))
    assert on_scrape(sig, StormState.calm, StormState.calm, None, None, TH).fire == ()


def test_stuck_counts_only_for_a_judged_replica() -> None:
    assert on_progress_check(State.ready, "no tokens") == Fire(Event.stuck, "no tokens")
    assert on_progress_check(State.starting, "no tokens") is None
    assert on_progress_check(State.ready, None) is None


def test_a_cause_still_present_reports_again_after_a_recovery_edge() -> None:
    sig = fresh(0.0)
    assert still_present(sig, StormState.calm) is None
    assert still_present(sig, StormState.storm) == Fire(Event.storm, "preemption storm still on")
    assert still_present(replace(sig, over_waiting=True), StormState.calm) == Fire(
        Event.not_ready, "queue still over the threshold"
    )
    assert still_present(replace(sig, deep_reported=True), StormState.calm) == Fire(
        Event.deep_probe_failed_n, "deep probes still failing"
    )


def test_a_restart_keeps_only_the_tallies() -> None:
    sig = replace(
        fresh(0.0),
        liveness_probes=9,
        liveness_failures=2,
        deep_streak=2,
        deep_inconclusive=3,
        over_waiting=True,
    )
    after = restarted(sig, now=50.0, verify=True)
    assert after.started_at == 50.0 and after.verify_with_deep_probe
    assert (after.liveness_probes, after.deep_inconclusive) == (9, 3)
    assert (after.liveness_failures, after.deep_streak, after.over_waiting) == (0, 0, False)


# ---- restarts, ledger, routing


def test_only_real_restarts_are_kept_as_restarts() -> None:
    assert ledger_entry(failure=True, restarted=True) is RecordKind.restart
    assert ledger_entry(failure=True, restarted=False) is RecordKind.failure
    assert ledger_entry(failure=False, restarted=True) is None  # the operator's restart
    assert needs_verification(failure=True, restarted=False)
    assert not needs_verification(failure=True, restarted=True)
    assert counts_as_failure(Event.stuck) and not counts_as_failure(Event.drained)
    assert counts_as_failure(Event.restart_requested, override=True)
    assert not counts_as_failure(Event.process_exited, override=False)


def test_routing_rule_and_weight() -> None:
    sig = fresh(0.0)
    ready = routing(
        State.ready, sig, "r", held=False, cordoned=False, health_score=0.8, waiting=3, th=TH
    )
    assert (ready.routable, ready.score, ready.saturated) == (True, 0.8, False)
    degraded = routing(
        State.degraded, sig, "r", held=False, cordoned=False, health_score=0.8, waiting=40, th=TH
    )
    assert degraded.routable and degraded.score == pytest.approx(0.2)
    assert degraded.saturated and degraded.saturation_reason == "40 waiting in the engine"
    failing = replace(sig, liveness_failures=1, liveness_error="timeout")
    one_failure = routing(
        State.ready, failing, "r", held=False, cordoned=False, health_score=1.0, waiting=None, th=TH
    )
    assert not one_failure.routable
    assert one_failure.reason == "liveness failed (timeout), 1 in a row"
    held = routing(
        State.ready, sig, "r", held=True, cordoned=False, health_score=1.0, waiting=None, th=TH
    )
    assert not held.routable and held.reason == "held out of routing by the operator"
    cordoned = routing(
        State.ready, sig, "r", held=False, cordoned=True, health_score=1.0, waiting=None, th=TH
    )
    assert not cordoned.routable
    starting = routing(
        State.starting, sig, "r", held=False, cordoned=False, health_score=1.0, waiting=None, th=TH
    )
    assert not starting.routable and starting.score == 1e-6


def test_busy_replicas_are_deep_probed_less_often_and_jitter_is_bounded() -> None:
    th = Thresholds(
        deep_probe_interval_s=5.0, deep_probe_idle_interval_s=2.5, deep_probe_jitter=0.2
    )
    assert deep_probe_delay_s(True, th, 0.0) == 5.0
    assert deep_probe_delay_s(False, th, 0.0) == 2.5
    assert deep_probe_delay_s(False, th, 1.0) == pytest.approx(3.0)
    assert deep_probe_delay_s(False, th, -7.0) == pytest.approx(2.0)  # clamped


# ---- loop lag


def test_loop_lag_counts_stall_time_inside_the_window() -> None:
    lag = LoopLag(interval_s=0.05)
    lag.woke(due=10.0, woke_at=10.3)  # a 0.3 s stall
    lag.woke(due=10.35, woke_at=10.351)  # noise below the floor: not kept
    lag.woke(due=11.0, woke_at=11.5)
    assert lag.stalled_s(10.0, 12.0, now=12.0) == pytest.approx(0.8)
    assert lag.stalled_s(10.2, 11.2, now=12.0) == pytest.approx(0.1 + 0.2)
    assert lag.stalled_s(12.0, 13.0, now=13.0) == 0.0


def test_a_stall_still_going_on_counts_while_the_sampler_is_overdue() -> None:
    lag = LoopLag(interval_s=0.05)
    lag.expect(due=20.0)
    # The probe's timeout fired at 20.6; the sampler, due at 20.0, has not run yet.
    assert lag.stalled_s(19.6, 20.6, now=20.6) == pytest.approx(0.6)
    lag.woke(due=20.0, woke_at=20.7)
    assert lag.stalled_s(19.6, 20.6, now=21.0) == pytest.approx(0.6)


def test_old_stalls_are_forgotten() -> None:
    lag = LoopLag(interval_s=0.05, horizon_s=60.0)
    lag.woke(due=0.0, woke_at=1.0)
    lag.woke(due=100.0, woke_at=100.01)
    assert lag.stalled_s(0.0, 2.0, now=101.0) == 0.0


@given(
    stalls=st.lists(st.tuples(st.floats(0, 5), st.floats(0.002, 2)), max_size=20),
    start=st.floats(0, 100),
    length=st.floats(0, 50),
)
def test_stall_time_never_exceeds_the_window(
    stalls: list[tuple[float, float]], start: float, length: float
) -> None:
    lag = LoopLag(interval_s=0.05, horizon_s=1e9)
    t = 0.0
    for gap, stall in stalls:
        t += gap
        lag.woke(due=t, woke_at=t + stall)
        t += stall
    assert 0.0 <= lag.stalled_s(start, start + length, now=start + length) <= length + 1e-9
