"""The replica state machine: every (state, event) pair against the table's invariants."""

from __future__ import annotations

import itertools

import pytest

from seawall.policy.health import TRANSITIONS, Action, Event, State, routable, step

ALL_PAIRS = list(itertools.product(State, Event))


@pytest.mark.parametrize(("state", "event"), ALL_PAIRS, ids=lambda v: str(v))
def test_every_pair_obeys_the_invariants(state: State, event: Event) -> None:
    t = step(state, event)
    assert t.actions, "a transition always names its actions (possibly none)"
    assert t.reason
    if Action.none in t.actions:
        assert t.actions == (Action.none,)

    # A state change is always recorded; a non-change never restarts or drains.
    if t.next != state:
        assert Action.record in t.actions
    else:
        assert not {Action.restart, Action.drain, Action.cordon_node} & set(t.actions)

    # Leaving a routable state for an unroutable one stops routing first.
    if routable(state) and not routable(t.next):
        assert t.actions[0] is Action.stop_routing

    # Nothing leaves cordoned except uncordon, and nothing restarts there otherwise.
    if state is State.cordoned and event is not Event.uncordon:
        assert t.next is State.cordoned
        assert Action.restart not in t.actions

    # Entering dead always orders the restart (cordoned replicas never enter dead).
    if t.next is State.dead and state is not State.dead:
        assert Action.restart in t.actions

    # Entering restarting always means the actuator must restart it.
    if t.next is State.restarting and state is not State.restarting:
        assert Action.restart in t.actions

    # Entering cordoned always cordons the node; draining always drains.
    if t.next is State.cordoned and state is not State.cordoned:
        assert Action.cordon_node in t.actions
    if t.next is State.draining and state is not State.draining:
        assert Action.drain in t.actions

    # Only a passed health check makes an unroutable replica routable.
    if not routable(state) and routable(t.next):
        assert (state, event) == (State.starting, Event.health_ok)

    # Unlisted pairs are ignored, visibly.
    if (state, event) not in TRANSITIONS:
        assert t.next is state
        assert t.actions == (Action.none,)
        assert t.reason.startswith("ignored: ")


def test_starting_tolerates_failures_until_the_allowance_runs_out() -> None:
    t = step(State.starting, Event.health_failed)
    assert t.next is State.starting and t.actions == (Action.none,)
    t = step(State.starting, Event.startup_timeout)
    assert t.next is State.restarting and Action.restart in t.actions


def test_hardware_fault_cordons_from_every_live_state_without_restart() -> None:
    for state in State:
        t = step(state, Event.hardware_fatal)
        assert t.next is State.cordoned
        assert Action.restart not in t.actions


def test_cordon_from_every_state_lands_in_cordoned() -> None:
    for state in State:
        assert step(state, Event.cordon).next is State.cordoned


def test_uncordon_brings_a_fresh_process() -> None:
    t = step(State.cordoned, Event.uncordon)
    assert t.next is State.restarting and Action.restart in t.actions


def test_dead_is_never_left_waiting_without_a_restart() -> None:
    # Every way into dead orders a restart, and from dead the only exits lead back to
    # service (restarted -> starting), to an explicit restart, or to cordoned.
    entries = [(s, e) for (s, e), t in TRANSITIONS.items() if t.next is State.dead]
    assert entries
    assert all(Action.restart in TRANSITIONS[p].actions for p in entries)
    exits = {t.next for (s, _), t in TRANSITIONS.items() if s is State.dead}
    assert exits <= {State.starting, State.restarting, State.cordoned}


def test_a_full_life_cycle() -> None:
    path = [
        (Event.health_ok, State.ready),
        (Event.storm, State.degraded),
        (Event.storm_cleared, State.ready),
        (Event.stuck, State.restarting),
        (Event.restarted, State.starting),
        (Event.health_ok, State.ready),
        (Event.drain_requested, State.draining),
        (Event.drained, State.restarting),
        (Event.restarted, State.starting),
        (Event.process_exited, State.dead),
        (Event.restarted, State.starting),
        (Event.health_ok, State.ready),
        (Event.cordon, State.cordoned),
        (Event.process_exited, State.cordoned),
        (Event.uncordon, State.restarting),
    ]
    state = State.starting
    for event, expected in path:
        state = step(state, event).next
        assert state is expected, event


def test_only_ready_and_degraded_are_routable() -> None:
    assert {s for s in State if routable(s)} == {State.ready, State.degraded}
