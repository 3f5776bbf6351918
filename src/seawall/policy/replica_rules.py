"""The fleet monitor's per-replica rules: what each probe, scrape and progress check means
for one replica, as pure functions over a frozen signal record.

Why here and not in the monitor. The monitor (`seawall.fleet.monitor`) is a shell: it
sends probes, scrapes /metrics, reads the gateway's counters and carries out actions.
What those results *mean* (how many liveness failures make a restart, when a failed
deep probe is only a queue, when a timeout was our own fault, when a replica may be
routed and at what weight) is decided here, over values, with `now` passed in. Each
rule returns a `Step`: the new `ReplicaSignals`, the edge events to feed the state
machine (`seawall.policy.health`), and what else the shell should do (start the one
deep probe that readmits a replica nothing restarted). So every rule is tested with
literal times (`tests/unit/test_policy_replica_rules.py`), without sockets or sleeps.

Three verdicts per probe, not two. A probe passes, fails, or is *inconclusive*:
- **Our own event loop was late.** The monitor shares the gateway's event loop. When
  that loop stalls (a flood of huge prompts being counted on it), a probe times out
  because we did not read the answer in time, not because the replica was slow. A
  timeout during which our loop stalled for at least `lag_spoils_fraction` of the
  probe's timeout says nothing about the replica (`LoopLag` measures the stalls).
- **The engine is busy, not broken.** llama.cpp queues a request until a slot frees,
  and vLLM does at `max_num_seqs`: a one-token probe waits behind long streams (4.7 s
  with 4 slots busy). A timed-out (or refused-for-load) deep probe while the replica
  visibly makes progress (its generation counter or the gateway's relayed chunks
  advanced during the probe) and has a queue (or exports none) is a queue. Tying
  liveness to the deep probe would take the busiest healthy replica out of routing.
An inconclusive probe changes no streak and no success ratio; it is counted and shown.

Must not: do I/O, read the clock, or import anything outside the standard library and
`seawall.policy`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, replace
from enum import StrEnum

from seawall.policy import health
from seawall.policy.health import Event, State
from seawall.policy.ledger import RecordKind
from seawall.policy.storm import StormState

# States in which a replica is probed and judged (it was healthy once since its start).
PROBED_STATES = frozenset({State.ready, State.degraded, State.draining})

# Events that say something is wrong with the replica (or its hardware). A restart they
# cause counts towards cordoning its failure domain; an operator's restart, an uncordon
# and the end of a requested drain do not.
FAILURE_EVENTS = frozenset(
    {
        Event.health_failed,
        Event.startup_timeout,
        Event.deep_probe_failed_n,
        Event.stuck,
        Event.process_exited,
    }
)

# Deep-probe errors that a busy engine gives for load rather than for being broken.
_BUSY_ERRORS = frozenset({"timeout", "http_429", "http_503"})


@dataclass(frozen=True, slots=True)
class Thresholds:
    """The numbers the rules read (from `FleetMonitorConfig`, documented there)."""

    startup_allowance_s: float = 600.0
    liveness_failures_threshold: int = 2
    deep_probe_failures_threshold: int = 3
    deep_probe_window: int = 20
    ready_waiting_threshold: float = 32.0
    deep_probe_interval_s: float = 5.0
    deep_probe_idle_interval_s: float = 2.5
    deep_probe_jitter: float = 0.2
    lag_spoils_fraction: float = 0.25


class Verdict(StrEnum):
    passed = "passed"
    failed = "failed"
    inconclusive = "inconclusive"


@dataclass(frozen=True, slots=True)
class Probe:
    """One probe as the shell saw it."""

    ok: bool
    error: str = ""  # "" when ok; "timeout", "connect", "http_503", "empty_output", ...
    latency_s: float = 0.0
    timeout_s: float = 1.0
    loop_lag_s: float = 0.0  # how long our own event loop stalled while it was out


@dataclass(frozen=True, slots=True)
class Progress:
    """What moved on a replica while a deep probe was out."""

    engine_tokens_advanced: bool = False  # the engine's generation counter went up
    chunks_relayed_advanced: bool = False  # the gateway relayed chunks from it
    waiting: float | None = None  # the engine's queue (None: the engine exports none)

    @property
    def moving(self) -> bool:
        return self.engine_tokens_advanced or self.chunks_relayed_advanced


@dataclass(frozen=True, slots=True)
class ReplicaSignals:
    """Everything the rules remember about one replica between two observations."""

    started_at: float  # monotonic: when the current process started (or was ordered to)
    liveness_probes: int = 0
    liveness_failures: int = 0  # conclusive failures in a row
    liveness_error: str = ""
    liveness_inconclusive: int = 0
    deep_streak: int = 0  # conclusive deep-probe failures in a row, since the last report
    deep_reported: bool = False  # a failure streak was reported and has not recovered
    deep_results: tuple[bool, ...] = ()  # the last `deep_probe_window` conclusive results
    deep_latency_s: float | None = None
    deep_inconclusive: int = 0
    last_inconclusive: str = ""
    over_waiting: bool = False  # `not_ready` was reported and `ready_again` not yet
    # After a failure "restart" that restarted nothing (actuator `none`), a passing
    # /health proves nothing: a hung engine answers it. Readmit only after a real token.
    verify_with_deep_probe: bool = False

    @property
    def deep_success_ratio(self) -> float | None:
        return sum(self.deep_results) / len(self.deep_results) if self.deep_results else None


@dataclass(frozen=True, slots=True)
class Fire:
    """One edge event for the state machine, with the detail for its reason."""

    event: Event
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Step:
    """A rule's answer: the new record and what the shell must do."""

    signals: ReplicaSignals
    fire: tuple[Fire, ...] = ()
    verdict: Verdict | None = None  # the probe's verdict, when the step judged one
    verify: bool = False  # start the readmitting deep probe (unless one is out)
    note: str | None = None  # a new reason for the replica without a transition


@dataclass(frozen=True, slots=True)
class Routing:
    """What the published `ReplicaView` says about routing to one replica."""

    routable: bool
    reason: str
    score: float  # health score times the state's routing weight, > 0
    saturated: bool
    saturation_reason: str


# ------------------------------------------------------------------------------ verdicts


def judge_probe(probe: Probe, th: Thresholds) -> tuple[Verdict, str]:
    """Pass, fail, or inconclusive because our own loop stalled through the timeout."""
    if probe.ok:
        return Verdict.passed, ""
    if probe.error == "timeout" and probe.loop_lag_s >= th.lag_spoils_fraction * probe.timeout_s:
        return Verdict.inconclusive, (
            f"timed out while our event loop stalled {probe.loop_lag_s:.2f} s "
            f"of the {probe.timeout_s:g} s timeout"
        )
    return Verdict.failed, probe.error


def judge_deep_probe(probe: Probe, progress: Progress, th: Thresholds) -> tuple[Verdict, str]:
    """`judge_probe`, and a probe that failed for load on a replica making progress is
    a queue, not a failure (see the module docstring)."""
    verdict, why = judge_probe(probe, th)
    if verdict is not Verdict.failed or probe.error not in _BUSY_ERRORS:
        return verdict, why
    queued = progress.waiting is None or progress.waiting > 0
    if progress.moving and queued:
        seen = "tokens" if progress.engine_tokens_advanced else "relayed chunks"
        queue = (
            "queue not exported" if progress.waiting is None else f"{progress.waiting:g} waiting"
        )
        return Verdict.inconclusive, (
            f"{probe.error} queued behind a busy engine ({seen} still moving, {queue})"
        )
    return verdict, why


def startup_expired(started_at: float, allowance_s: float, now: float) -> bool:
    """True once a replica that has not yet been healthy has used up its allowance."""
    return now - started_at >= allowance_s


# ------------------------------------------------------------------------------ rules


def fresh(now: float, verify_with_deep_probe: bool = False) -> ReplicaSignals:
    """The record of a replica that has just (re)started: no evidence carries over."""
    return ReplicaSignals(started_at=now, verify_with_deep_probe=verify_with_deep_probe)


def restarted(signals: ReplicaSignals, now: float, verify: bool) -> ReplicaSignals:
    """After a restart: fresh evidence; the probe counts and inconclusive tallies stay."""
    return replace(
        fresh(now, verify),
        liveness_probes=signals.liveness_probes,
        liveness_inconclusive=signals.liveness_inconclusive,
        deep_inconclusive=signals.deep_inconclusive,
        last_inconclusive=signals.last_inconclusive,
    )


def on_process_started(signals: ReplicaSignals, state: State, now: float) -> ReplicaSignals:
    """The actuator reports a new process: its startup allowance runs from now (a crash
    backoff before the start must not eat into the time the engine has to load)."""
    if state is not State.starting:
        return signals
    return replace(signals, started_at=now)


def on_liveness(
    signals: ReplicaSignals, state: State, probe: Probe, now: float, th: Thresholds
) -> Step:
    """One GET /health. Starting replicas fail quietly until their allowance runs out;
    a healthy one fails on `liveness_failures_threshold` conclusive failures in a row
    (one already stops routing, see `routing`)."""
    if state is State.restarting:
        return Step(signals)
    verdict, why = judge_probe(probe, th)
    sig = replace(signals, liveness_probes=signals.liveness_probes + 1)
    if verdict is Verdict.inconclusive:
        sig = replace(
            sig, liveness_inconclusive=sig.liveness_inconclusive + 1, last_inconclusive=why
        )
        return Step(sig, verdict=verdict)
    if state is State.starting:
        if verdict is Verdict.passed:
            sig = replace(sig, liveness_failures=0, liveness_error="")
            if sig.verify_with_deep_probe:
                return Step(sig, verdict=verdict, verify=True)
            return Step(sig, (Fire(Event.health_ok),), verdict)
        # Failures while loading are expected: shown, not counted.
        sig = replace(sig, liveness_error=probe.error)
        if startup_expired(sig.started_at, th.startup_allowance_s, now):
            detail = f"not healthy after {th.startup_allowance_s:g} s (last: {probe.error})"
            return Step(sig, (Fire(Event.startup_timeout, detail),), verdict)
        return Step(sig, verdict=verdict)
    if verdict is Verdict.passed:
        return Step(replace(sig, liveness_failures=0, liveness_error=""), verdict=verdict)
    failures = sig.liveness_failures + 1
    sig = replace(sig, liveness_failures=failures, liveness_error=probe.error)
    if failures >= th.liveness_failures_threshold:
        detail = f"liveness failed {failures} times in a row ({probe.error})"
        return Step(sig, (Fire(Event.health_failed, detail),), verdict)
    return Step(sig, verdict=verdict)


def on_deep_probe(
    signals: ReplicaSignals, probe: Probe, progress: Progress, th: Thresholds
) -> Step:
    """One real one-token completion from a probed replica. A streak of
    `deep_probe_failures_threshold` conclusive failures reports `deep_probe_failed_n`
    once; the next pass reports `deep_probe_ok`."""
    verdict, why = judge_deep_probe(probe, progress, th)
    if verdict is Verdict.inconclusive:
        sig = replace(
            signals, deep_inconclusive=signals.deep_inconclusive + 1, last_inconclusive=why
        )
        return Step(sig, verdict=verdict)
    results = (*signals.deep_results, verdict is Verdict.passed)[-th.deep_probe_window :]
    if verdict is Verdict.passed:
        sig = replace(
            signals,
            deep_results=results,
            deep_latency_s=probe.latency_s,
            deep_streak=0,
            deep_reported=False,
        )
        fire = (Fire(Event.deep_probe_ok),) if signals.deep_reported else ()
        return Step(sig, fire, verdict)
    streak = signals.deep_streak + 1
    if streak >= th.deep_probe_failures_threshold:
        sig = replace(signals, deep_results=results, deep_streak=0, deep_reported=True)
        detail = f"{th.deep_probe_failures_threshold} deep probes failed in a row ({probe.error})"
        return Step(sig, (Fire(Event.deep_probe_failed_n, detail),), verdict)
    return Step(replace(signals, deep_results=results, deep_streak=streak), verdict=verdict)


def on_verification(
    signals: ReplicaSignals, state: State, probe: Probe, progress: Progress, th: Thresholds
) -> Step:
    """The one deep probe that readmits a replica whose failure restarted nothing."""
    if state is not State.starting or not signals.verify_with_deep_probe:
        return Step(signals)
    verdict, why = judge_deep_probe(probe, progress, th)
    if verdict is Verdict.passed:
        sig = replace(signals, verify_with_deep_probe=False)
        return Step(sig, (Fire(Event.health_ok, "a deep probe produced a token again"),), verdict)
    if verdict is Verdict.inconclusive:
        sig = replace(
            signals, deep_inconclusive=signals.deep_inconclusive + 1, last_inconclusive=why
        )
        return Step(sig, verdict=verdict, note=f"healthy; the token check was inconclusive ({why})")
    return Step(
        signals, verdict=verdict, note=f"healthy but still not producing tokens ({probe.error})"
    )


def on_scrape(
    signals: ReplicaSignals,
    storm_before: StormState,
    storm_after: StormState,
    storm_rate_per_s: float | None,
    waiting: float | None,
    th: Thresholds,
) -> Step:
    """One /metrics scrape: the edges of the storm detector and of the queue threshold."""
    fire: list[Fire] = []
    if storm_before is StormState.calm and storm_after is StormState.storm:
        fire.append(Fire(Event.storm, f"preemptions at {storm_rate_per_s or 0.0:.1f}/s"))
    elif storm_before is StormState.storm and storm_after is StormState.calm:
        fire.append(Fire(Event.storm_cleared))
    sig = signals
    if waiting is not None:
        over = waiting > th.ready_waiting_threshold
        if over and not signals.over_waiting:
            sig = replace(sig, over_waiting=True)
            fire.append(Fire(Event.not_ready, f"{waiting:g} waiting"))
        elif not over and signals.over_waiting:
            sig = replace(sig, over_waiting=False)
            fire.append(Fire(Event.ready_again))
    return Step(sig, tuple(fire))


def on_progress_check(state: State, stuck_reason: str | None) -> Fire | None:
    """The progress watchdog's verdict becomes `stuck` for a replica that is judged."""
    if stuck_reason is None or state not in PROBED_STATES:
        return None
    return Fire(Event.stuck, stuck_reason)


def still_present(signals: ReplicaSignals, storm: StormState) -> Fire | None:
    """Back to ready on one recovery edge (the table tracks one cause): a cause of
    degradation that is still present reports again."""
    if storm is StormState.storm:
        return Fire(Event.storm, "preemption storm still on")
    if signals.over_waiting:
        return Fire(Event.not_ready, "queue still over the threshold")
    if signals.deep_reported:
        return Fire(Event.deep_probe_failed_n, "deep probes still failing")
    return None


def counts_as_failure(event: Event, override: bool | None = None) -> bool:
    """Whether a restart caused by `event` says something about the replica's health."""
    return event in FAILURE_EVENTS if override is None else override


def ledger_entry(failure: bool, restarted: bool) -> RecordKind | None:
    """What the restart ledger keeps for a restart action: every failure is kept, as a
    restart only when something really restarted (only those count towards a cordon);
    an operator's restart that worked is not a failure and is not kept."""
    if not failure:
        return None
    return RecordKind.restart if restarted else RecordKind.failure


def needs_verification(failure: bool, restarted: bool) -> bool:
    """After a failure nothing restarted, /health alone cannot readmit the replica."""
    return failure and not restarted


def deep_probe_delay_s(
    busy: bool, th: Thresholds, jitter_draw: float, min_interval_s: float | None = None
) -> float:
    """Seconds until the next deep probe. Busy replicas prove themselves by relaying
    tokens, so they are probed less often; `jitter_draw` in [-1, 1] spreads probes.
    `min_interval_s` is a floor (a remote pool's GPUs are someone else's)."""
    base_s = th.deep_probe_interval_s if busy else th.deep_probe_idle_interval_s
    delay = base_s * (1.0 + th.deep_probe_jitter * max(-1.0, min(1.0, jitter_draw)))
    return max(delay, min_interval_s) if min_interval_s is not None else delay


def routing(
    state: State,
    signals: ReplicaSignals,
    reason: str,
    *,
    held: bool,
    cordoned: bool,
    health_score: float,
    waiting: float | None,
    th: Thresholds,
) -> Routing:
    """The routing rule: routable when the state routes, the last liveness probe passed
    (one failure is enough to stop sending new work: it is cheap to be wrong for a
    second), no operator hold, and the failure domain is not cordoned. The score is the
    health score times the state's weight, so a degraded replica gets a quarter share."""
    routable = (
        health.routable(state) and signals.liveness_failures == 0 and not held and not cordoned
    )
    if held:
        reason = "held out of routing by the operator"
    elif signals.liveness_failures and state in PROBED_STATES:
        reason = f"liveness failed ({signals.liveness_error}), {signals.liveness_failures} in a row"
    saturated = waiting is not None and waiting > th.ready_waiting_threshold
    return Routing(
        routable=routable,
        reason=reason,
        score=max(health_score * health.ROUTING_WEIGHT[state], 1e-6),
        saturated=saturated,
        saturation_reason=f"{waiting:g} waiting in the engine" if saturated else "",
    )


# ------------------------------------------------------------------------------ loop lag


class LoopLag:
    """Stalls of the caller's event loop, measured by a sampler that asks to wake every
    `interval_s` and reports when it really woke: each late wake-up is a stall from the
    time it was due until it ran. `stalled_s(start, end, now)` is the stall time inside
    [start, end], counting a stall still in progress (the sampler overdue at `now`).

    Stalls shorter than `floor_s` are not kept (scheduling noise); those older than
    `horizon_s` are dropped, so memory stays bounded however long the loop runs.
    """

    def __init__(self, interval_s: float, horizon_s: float = 120.0, floor_s: float = 0.002):
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.interval_s = interval_s
        self.horizon_s = horizon_s
        self.floor_s = floor_s
        self._stalls: deque[tuple[float, float]] = deque()  # (due, woke), by due time
        self._due: float | None = None

    def expect(self, due: float) -> None:
        """The sampler is asleep and should wake at `due`."""
        self._due = due

    def woke(self, due: float, woke_at: float) -> None:
        self._due = None
        if woke_at - due >= self.floor_s:
            self._stalls.append((due, woke_at))
        while self._stalls and self._stalls[0][1] < woke_at - self.horizon_s:
            self._stalls.popleft()

    def stalled_s(self, start: float, end: float, now: float) -> float:
        if end <= start:
            return 0.0
        stalls = list(self._stalls)
        if self._due is not None and now > self._due:
            stalls.append((self._due, now))  # the sampler is overdue: a stall going on
        first = bisect_left([woke for _, woke in stalls], start)
        total = 0.0
        for due, woke in stalls[first:]:
            if due >= end:
                break
            total += max(0.0, min(woke, end) - max(due, start))
        return total


__all__ = [
    "FAILURE_EVENTS",
    "PROBED_STATES",
    "Fire",
    "LoopLag",
    "Probe",
    "Progress",
    "ReplicaSignals",
    "Routing",
    "Step",
    "Thresholds",
    "Verdict",
    "counts_as_failure",
    "deep_probe_delay_s",
    "fresh",
    "judge_deep_probe",
    "judge_probe",
    "ledger_entry",
    "needs_verification",
    "on_deep_probe",
    "on_liveness",
    "on_process_started",
    "on_progress_check",
    "on_scrape",
    "on_verification",
    "restarted",
    "routing",
    "startup_expired",
    "still_present",
]
