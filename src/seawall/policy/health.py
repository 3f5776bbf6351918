"""The replica lifecycle as a table: which signal moves a replica to which state, and what
the actuator must do about it.

Why a table. Replica health has many inputs (liveness probes, deep probes, the progress
watchdog, the preemption-storm detector, readiness, operator requests, process exits,
hardware faults) and a few outputs (route or not, drain, restart, cordon the node).
Written as if/else across the monitors, the interesting questions ("can a starting
replica be restarted for failing its first probe?", "can anything restart a replica on a
cordoned node?") have no single place to be answered. As one table they are rows a
reader can check and a test can enumerate: `tests/unit/test_policy_health.py` walks
every (state, event) pair and asserts the invariants below.

States:
  starting    process launched, not yet passed a health check; not routed. Failing
              health checks here is expected (weights loading), so `health_failed` does
              nothing; only `startup_timeout` (the startup allowance ran out) restarts.
  ready       healthy; routed at full weight.
  degraded    serving but worse than it should (deep probes failing, a preemption storm,
              queue over the readiness threshold); routed at reduced weight.
  draining    no new work; in-flight requests finish, then `drained` restarts it.
  restarting  the actuator is stopping and starting the process.
  dead        the process exited on its own; the transition into `dead` always carries
              a restart (unless the replica is cordoned).
  cordoned    the node is out of service (hardware fault, or too many restarts: see
              `ledger.should_cordon`): replicas are drained and not restarted. Only
              `uncordon` leaves this state.

Events are edges, not levels: the fleet controller sends `storm` once when the storm
detector enters a storm and `storm_cleared` once when it leaves it, `deep_probe_failed_n`
once when the consecutive-failure threshold is reached and `deep_probe_ok` when a deep
probe passes again, and so on. A degraded replica returns to ready on the first recovery
edge (`deep_probe_ok`, `storm_cleared`, `ready_again`); the table does not track several
concurrent causes of degradation. If another cause is still present, its monitor reports
it again and the replica is degraded again: routing weight and the health score (see
`score`) still reflect the live inputs in the meantime.

Must not: perform the actions, read the clock, or count anything (thresholds and
windows belong to the monitors that emit the events). `step` is a lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class State(StrEnum):
    starting = "starting"
    ready = "ready"
    degraded = "degraded"
    draining = "draining"
    restarting = "restarting"
    dead = "dead"
    cordoned = "cordoned"


class Event(StrEnum):
    health_ok = "health_ok"
    health_failed = "health_failed"
    startup_timeout = "startup_timeout"
    deep_probe_ok = "deep_probe_ok"
    deep_probe_failed_n = "deep_probe_failed_n"  # consecutive-failure threshold reached
    stuck = "stuck"  # progress watchdog: work in flight, no tokens moving
    storm = "storm"
    storm_cleared = "storm_cleared"
    not_ready = "not_ready"  # queue over the readiness threshold
    ready_again = "ready_again"
    drain_requested = "drain_requested"
    drained = "drained"
    restart_requested = "restart_requested"
    restarted = "restarted"
    cordon = "cordon"
    uncordon = "uncordon"
    process_exited = "process_exited"
    hardware_fatal = "hardware_fatal"


class Action(StrEnum):
    """What the actuator (or the fleet controller) must do on a transition."""

    none = "none"
    stop_routing = "stop_routing"  # publish the replica as unroutable before anything else
    drain = "drain"  # let in-flight requests finish, then report `drained`
    restart = "restart"  # stop (if running) and start the process, then report `restarted`
    cordon_node = "cordon_node"  # mark the node unschedulable; drain its replicas
    record = "record"  # write the transition (and its reason) to the log/ledger


@dataclass(frozen=True, slots=True)
class Transition:
    next: State
    reason: str
    actions: tuple[Action, ...]


S, E, A = State, Event, Action

_RECORD = (A.record,)
_RESTART = (A.stop_routing, A.restart, A.record)
_DRAIN = (A.stop_routing, A.drain, A.record)
_DIED = (A.stop_routing, A.restart, A.record)
_CORDON = (A.stop_routing, A.drain, A.cordon_node, A.record)
# A fatal hardware fault: the GPU is gone, so in-flight work cannot finish; draining
# would only wait for the timeouts. Cordon and stop routing at once.
_HARDWARE = (A.stop_routing, A.cordon_node, A.record)


def _t(next_state: State, reason: str, actions: tuple[Action, ...]) -> Transition:
    return Transition(next_state, reason, actions)


# Rows that apply the same way wherever the replica is serving or about to serve.
def _common(state: State) -> dict[tuple[State, Event], Transition]:
    return {
        (state, E.restart_requested): _t(S.restarting, "restart requested", _RESTART),
        (state, E.cordon): _t(S.cordoned, "node cordoned", _CORDON),
        (state, E.process_exited): _t(S.dead, "process exited", _DIED),
        (state, E.hardware_fatal): _t(S.cordoned, "fatal hardware fault", _HARDWARE),
    }


TRANSITIONS: dict[tuple[State, Event], Transition] = {
    # starting: not routed yet; failures are expected until the startup allowance ends.
    **_common(S.starting),
    (S.starting, E.health_ok): _t(S.ready, "passed health check after start", _RECORD),
    (S.starting, E.health_failed): _t(
        S.starting, "health check failed within the startup allowance", (A.none,)
    ),
    (S.starting, E.startup_timeout): _t(
        S.restarting, "not healthy within the startup allowance", _RESTART
    ),
    (S.starting, E.drain_requested): _t(S.draining, "drain requested", _DRAIN),
    # ready: routed at full weight.
    **_common(S.ready),
    (S.ready, E.health_failed): _t(S.restarting, "health check failed", _RESTART),
    (S.ready, E.deep_probe_failed_n): _t(S.degraded, "deep probes failing", _RECORD),
    (S.ready, E.stuck): _t(S.restarting, "no progress with work in flight", _RESTART),
    (S.ready, E.storm): _t(S.degraded, "preemption storm", _RECORD),
    (S.ready, E.not_ready): _t(S.degraded, "queue over the readiness threshold", _RECORD),
    (S.ready, E.drain_requested): _t(S.draining, "drain requested", _DRAIN),
    # degraded: routed at reduced weight; a second deep-probe failure streak restarts.
    **_common(S.degraded),
    (S.degraded, E.deep_probe_ok): _t(S.ready, "deep probe passed", _RECORD),
    (S.degraded, E.storm_cleared): _t(S.ready, "preemption storm cleared", _RECORD),
    (S.degraded, E.ready_again): _t(S.ready, "queue back under the threshold", _RECORD),
    (S.degraded, E.health_failed): _t(S.restarting, "health check failed", _RESTART),
    (S.degraded, E.deep_probe_failed_n): _t(
        S.restarting, "deep probes still failing while degraded", _RESTART
    ),
    (S.degraded, E.stuck): _t(S.restarting, "no progress with work in flight", _RESTART),
    (S.degraded, E.drain_requested): _t(S.draining, "drain requested", _DRAIN),
    # draining: not routed; the drain ends in a restart (a drain is a graceful restart).
    **_common(S.draining),
    (S.draining, E.drained): _t(S.restarting, "drained", (A.restart, A.record)),
    (S.draining, E.health_failed): _t(S.restarting, "health check failed while draining", _RESTART),
    (S.draining, E.stuck): _t(S.restarting, "drain cannot finish: no progress", _RESTART),
    # restarting: the actuator is at work; an exit is expected, so it is not an event here.
    (S.restarting, E.restarted): _t(S.starting, "restarted", _RECORD),
    (S.restarting, E.cordon): _t(S.cordoned, "node cordoned", _CORDON),
    (S.restarting, E.hardware_fatal): _t(S.cordoned, "fatal hardware fault", _HARDWARE),
    # dead: the restart was ordered on entry; wait for it.
    (S.dead, E.restarted): _t(S.starting, "restarted", _RECORD),
    (S.dead, E.restart_requested): _t(S.restarting, "restart requested", _RESTART),
    (S.dead, E.cordon): _t(S.cordoned, "node cordoned", _CORDON),
    (S.dead, E.hardware_fatal): _t(S.cordoned, "fatal hardware fault", _HARDWARE),
    # cordoned: nothing but an operator's uncordon brings it back, with a fresh process.
    (S.cordoned, E.uncordon): _t(S.restarting, "node uncordoned", (A.restart, A.record)),
}


def step(state: State, event: Event) -> Transition:
    """The transition for `event` in `state`; an event with no row leaves the state as is."""
    found = TRANSITIONS.get((state, event))
    if found is not None:
        return found
    return Transition(state, f"ignored: {event.value} in {state.value}", (Action.none,))


# Routing weight per state: degraded replicas still take work (they may be the only
# capacity left) but at a quarter of the share a ready replica with the same load gets.
ROUTING_WEIGHT: dict[State, float] = {
    State.starting: 0.0,
    State.ready: 1.0,
    State.degraded: 0.25,
    State.draining: 0.0,
    State.restarting: 0.0,
    State.dead: 0.0,
    State.cordoned: 0.0,
}


def routable(state: State) -> bool:
    """Whether new requests may be sent to a replica in `state` (ready or degraded)."""
    return ROUTING_WEIGHT[state] > 0.0
