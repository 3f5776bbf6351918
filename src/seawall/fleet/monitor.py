"""The fleet monitor: probes every replica off the request path, feeds the results to the
pure rules, carries out what they decide, and publishes the fleet view.

The monitor executes; pure functions decide. This module is the shell around
`seawall.policy`: it sends the probes and scrapes, reads the gateway's counters and
the clock, and hands each result to a rule in `policy.replica_rules` (what a probe
means, when a streak is a failure, when a timeout was our own loop's fault or a busy
engine's queue, the routing rule and weight). A rule answers with the replica's new
signal record and edge events; each event goes through the state machine
(`policy.health.step`) and every action of the transition is executed here, matched
exhaustively: stop routing (publish now), drain (wait until the gateway has nothing in
flight on the replica, then report `drained`), restart (through the `Actuator`; only
a real restart counts towards a cordon, see `policy.ledger`), cordon the failure
domain (ledger, actuator, hardware ticket) and record (history and log).

Per replica: a liveness loop (GET /health, with the startup allowance), a scrape loop
(/metrics through the engine adapter: watchdog, storm detector, health score) and a
deep-probe loop (one real token, jittered, idle replicas more often); per node with
DCGM configured, a DCGM loop; and one loop-lag sampler that measures how late our own
event loop runs, so that a probe spoiled by our lateness is inconclusive. After each
change a new immutable `FleetSnapshot` is swapped in: `snapshot()` is an attribute read.
A replica's health score is recomputed at its own liveness probes, scrapes and deep
probes (against fleet medians at most `MEDIANS_TTL_S` old; a deep probe recomputes them
and rescores every replica); a change to one replica publishes its view alone, the
others' view objects kept, so a subscriber can skip a view it has seen (`is`).
The admin presenter (`present.py`), the metrics export (`export.py`, a snapshot
subscriber) and hardware tickets (`seawall.actuate.tickets`) live elsewhere.

Roles: one leader, many followers (several gateway instances, `seawall.cluster`). A
monitor that leads (the default, and always for a single instance) does all of the
above. A follower's monitor runs no loops at all: no probes, no scrapes, no watchdog,
no actions; `apply_view` makes its snapshot the leader's published view (its records
follow the view too, for the admin API); on a view too old to refresh (fail-static),
`hold_view` keeps it without its stale engine readings. `lead()` turns a follower into the leader
without a blip: every replica keeps the state the last view gave it (a ready replica
stays ready while the new leader's first probes go out), a replica the old leader was
draining is drained again, one it was restarting is `starting`, and the cordons come
back from the shared ledger. `follow()` stops every leader loop and action. The
leader's `export_view` is what the cluster publishes. The request path is unchanged
either way: it reads `snapshot()`.

Must not: sit on the request path (the gateway reads `snapshot()` and never awaits the
monitor), decide what belongs to the policies, or read time other than through
`seawall.clock`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import statistics
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, assert_never

import aiohttp
import orjson

from seawall import clock
from seawall.actuate.base import Actuator, Evidence, NoActuator
from seawall.actuate.tickets import HardwareTickets
from seawall.fleet import present, probes
from seawall.fleet.adapters import Adapter, EngineKind, adapter_for, detect_engine
from seawall.fleet.config import FleetMonitorConfig
from seawall.fleet.discovery import Discovery, Endpoint, watch
from seawall.fleet.export import FleetMetricFamilies, FleetMetrics
from seawall.fleet.gpu import HEALTHY, GpuHealth, assess, parse_dcgm
from seawall.fleet.published import PublishedReplica, PublishedView
from seawall.fleet.signals import GatewaySignals, NoGatewaySignals, Observed
from seawall.fleet.tracked import ReplicaSpec, TrackedDomain, TrackedReplica, TransitionRecord
from seawall.fleet.view import EngineLoad, FleetSnapshot, ReplicaView
from seawall.policy import health
from seawall.policy import replica_rules as rules
from seawall.policy.health import Action, Event, State, Transition
from seawall.policy.ledger import RecordKind, RestartRecord, should_cordon
from seawall.policy.replica_rules import PROBED_STATES, Probe, Progress, Step, Verdict
from seawall.policy.score import HealthScore, ScoreInputs
from seawall.policy.storm import StormDetector
from seawall.policy.watchdog import ProgressWatchdog
from seawall.state.ledger import Ledger, LedgerError, RestartLedger

log = logging.getLogger(__name__)

# Scrapes that found no /metrics (plain OpenAI servers) or an unknown engine are retried
# this many intervals apart: the answer rarely changes and the deep probe decides anyway.
_ABSENT_BACKOFF = 10
# The loop-lag sampler wakes this often. Its resolution does not depend on it (a stall
# shows as a late wake-up whatever the interval); 20 wake-ups a second cost nothing.
_LAG_SAMPLE_S = 0.05
# A replica's own rescore (at its scrape and liveness probe, each second) judges it
# against fleet medians at most this old: recomputing them at each rescore was O(fleet)
# a rescore, O(fleet²) a second (`bench_scrape.py --fleet`).
MEDIANS_TTL_S = 1.0


class FleetMonitor:
    """Watches replicas and keeps `snapshot()` true. See the module docstring."""

    def __init__(
        self,
        config: FleetMonitorConfig,
        replicas: Iterable[ReplicaSpec] = (),
        *,
        actuator: Actuator | None = None,
        metrics: FleetMetricFamilies | None = None,
        signals: GatewaySignals | None = None,
        ledger: Ledger | None = None,
        session: aiohttp.ClientSession | None = None,
        score: HealthScore | None = None,
        rng: random.Random | None = None,
        leading: bool = True,
        credentials: Callable[[str], str | None] | None = None,
    ) -> None:
        self.config = config
        # A replica's API key, read at each probe (a reload may change it); never stored
        # in its spec, which is logged, published and compared.
        self._credentials = credentials
        self.actuator: Actuator = actuator or NoActuator()
        self.signals: GatewaySignals = signals or NoGatewaySignals()
        self._th = _thresholds(config)
        self._ledger = ledger
        self._owns_ledger = ledger is None
        self._session = session
        self._owns_session = session is None
        self._score = score or HealthScore()
        self._rng = rng or random.Random()
        self._replicas: dict[str, TrackedReplica] = {}
        self._medians: _Medians | None = None  # `_rescore`'s, kept up to MEDIANS_TTL_S
        self._domains: dict[str, TrackedDomain] = {}
        self._snapshot = FleetSnapshot()
        self._listeners: list[Callable[[FleetSnapshot], None]] = []
        self._export = FleetMetrics(metrics) if metrics is not None else None
        if self._export is not None:
            self._listeners.append(self._export.on_snapshot)
        self._tickets = HardwareTickets(
            config.hardware_ticket_webhook_url,
            config.webhook_timeout_s,
            self._export.ticket_opened if self._export is not None else None,
        )
        self._lag = rules.LoopLag(_LAG_SAMPLE_S)
        self._background: set[asyncio.Task[None]] = set()
        self._history: deque[TransitionRecord] = deque(maxlen=50)
        self._running = False
        self._pending = list(replicas)
        self._leading = leading
        self._lag_task: asyncio.Task[None] | None = None
        self._discovery: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        if self._ledger is None:
            self._ledger = RestartLedger(self.config.ledger_path)
        if self._session is None:
            self._session = aiohttp.ClientSession()
        self._lag_task = self._spawn(self._lag_loop())
        if self._leading:
            await self._restore_cordons()
        pending, self._pending = self._pending, []
        for spec in pending:
            self.add_replica(spec)
        if self._leading:
            self._start_domain_loops()
        self._publish(force=True)

    async def _restore_cordons(self) -> None:
        """Cordons outlive the monitor (and its leadership): a domain cordoned before a
        redeploy or a fail-over stays cordoned, its replicas never routable in between."""
        try:
            cordons = await self.ledger.cordoned_nodes()
        except LedgerError as e:
            log.error("could not read the cordons from the restart ledger: %s", e)
            return
        for name, record in cordons.items():
            d = self._domain(name)
            d.cordoned, d.since_wall, d.evidence = True, record.since_wall, record.evidence
            # The actuator must know too: a local supervisor would otherwise restart
            # replicas in a domain the ledger says is cordoned.
            await self.actuator.cordon(name, record.evidence or Evidence(name, ("restored",)))
            for rep in self._in_domain(name):
                self._fire(rep, Event.cordon, "node is cordoned (kept in the ledger)")

    def _start_domain_loops(self) -> None:
        for node, url in self.config.dcgm.items():
            self._domain(node).task = self._spawn(self._dcgm_loop(node, url))

    async def stop(self) -> None:
        """Cancel every loop and action; close what the monitor opened itself."""
        self._running = False
        tasks = [t for rep in self._replicas.values() for t in rep.tasks]
        tasks += [d.task for d in self._domains.values() if d.task is not None]
        tasks += list(self._background)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None
        if self._owns_ledger and self._ledger is not None:
            await self._ledger.close()
            self._ledger = None

    async def __aenter__(self) -> FleetMonitor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def leading(self) -> bool:
        return self._leading

    @property
    def ledger(self) -> Ledger:
        assert self._ledger is not None, "FleetMonitor.start() opens the ledger"
        return self._ledger

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "FleetMonitor.start() opens the session"
        return self._session

    # ---------------------------------------------------------------- the read side

    def snapshot(self) -> FleetSnapshot:
        """The current view: an attribute read, safe on the request path."""
        return self._snapshot

    def subscribe(self, listener: Callable[[FleetSnapshot], None]) -> None:
        """Called with every new snapshot (in the monitor's task; keep it short)."""
        self._listeners.append(listener)

    def describe(self) -> dict[str, Any]:
        """What the admin API serves: every replica and domain, with the why."""
        return present.describe(
            self._replicas.values(),
            self._domains.values(),
            self._history,
            self._snapshot,
            self.signals,
            clock.monotonic(),
        )

    # ---------------------------------------------------------------- replica set

    def add_replica(self, spec: ReplicaSpec) -> None:
        """Start monitoring `spec` (as `starting`); a known id is left as it is."""
        if not self._running:
            self._pending.append(spec)
            return
        if spec.replica_id in self._replicas:
            return
        rep = self._new_replica(spec)
        self._replicas[spec.replica_id] = rep
        rep.tasks = [self._spawn(loop, keep=False) for loop in self._replica_loops(rep)]
        if self._domain(spec.domain).cordoned:
            self._fire(rep, Event.cordon, "node is cordoned (kept in the ledger)")
        self._publish()

    def watches(self, replica_id: str) -> bool:
        """Whether the replica is monitored (or will be, once the monitor starts)."""
        return replica_id in self._replicas or any(
            s.replica_id == replica_id for s in self._pending
        )

    def _replica_loops(self, rep: TrackedReplica) -> list[Coroutine[Any, Any, None]]:
        if not self._leading:
            return []  # a follower probes nothing: the leader's view says it all
        return [self._liveness_loop(rep), self._scrape_loop(rep), self._deep_loop(rep)]

    def remove_replica(self, replica_id: str) -> None:
        rep = self._replicas.pop(replica_id, None)
        if rep is None:
            return
        for t in rep.tasks:
            t.cancel()
        # A restart already under way is the node's business too: its ledger row and the
        # cordon it may complete must survive the replica leaving discovery, which its
        # own pod deletion causes (and may report before the actuator's call returns).
        # It is bounded by the actuator's and the ledger's timeouts; anything else stops.
        if rep.action is not None and rep.action_kind != "restart":
            rep.action.cancel()
        self._publish()

    def set_replicas(self, specs: Sequence[ReplicaSpec]) -> None:
        """Reconcile with a discovered set: add the new, drop the gone, keep the rest."""
        wanted = {s.replica_id: s for s in specs}
        for rid, rep in list(self._replicas.items()):
            # Same id at a new address (a StatefulSet pod recreated): start it afresh.
            if wanted.get(rid) != rep.spec:
                self.remove_replica(rid)
        for spec in specs:
            self.add_replica(spec)

    def start_discovery(
        self,
        discovery: Discovery,
        interval_s: float,
        model: str = "",
        engine: str = "auto",
        apply: Callable[[list[ReplicaSpec]], None] | None = None,
    ) -> None:
        """Re-resolve `discovery` every `interval_s` and reconcile with each new set.

        `apply` receives the specs instead of `set_replicas` when the caller keeps its
        own replica list too (the gateway routes from its own set and must add and drop
        replicas in both).
        """
        stop = asyncio.Event()
        reconcile = apply or self.set_replicas

        def changed(endpoints: frozenset[Endpoint]) -> None:
            reconcile([_spec_from(e, model, engine) for e in sorted(endpoints)])

        self.stop_discovery()
        self._discovery = self._spawn(watch(discovery, interval_s, changed, stop))

    def stop_discovery(self) -> None:
        """Stop re-resolving (a follower's membership comes from the leader's view)."""
        if self._discovery is not None:
            self._discovery.cancel()
            self._discovery = None

    # ---------------------------------------------------------------- roles

    async def lead(self) -> None:
        """Become the leader: start every loop, carrying on from the last applied view."""
        if self._leading:
            return
        self._leading = True
        if not self._running:
            return  # `start()` does the rest
        now = clock.monotonic()
        for rep in self._replicas.values():
            self._seed(rep, now)
        await self._restore_cordons()
        for rep in self._replicas.values():
            rep.tasks = [self._spawn(loop, keep=False) for loop in self._replica_loops(rep)]
            if rep.state is State.draining:
                # The old leader was waiting for this drain; the wait starts again here.
                self._act(rep, "drain", self._drain(rep))
        self._start_domain_loops()
        self._publish(force=True)

    def _seed(self, rep: TrackedReplica, now: float) -> None:
        """A replica's records when leadership moves to this monitor: its state stays
        (see the module docstring); the rules' evidence starts afresh, except that a
        degraded replica is readmitted by its next passing deep probe, and the startup
        allowance keeps running from the real start."""
        sig = rules.fresh(rep.signals.started_at, rep.signals.verify_with_deep_probe)
        if rep.state in (State.restarting, State.dead):
            before = rep.state
            rep.state = State.starting
            rep.reason = "leadership moved during its restart; waiting for a healthy probe"
            sig = rules.fresh(now, sig.verify_with_deep_probe)
            self._record(rep, "seeded", before, rep.state, rep.reason)
        elif rep.state is State.degraded:
            sig = dataclasses.replace(sig, deep_reported=True)
        rep.signals = sig
        rep.watchdog = ProgressWatchdog(self.config.watchdog_window_s)
        rep.storm = self._new_storm()
        rep.verifying = False

    def follow(self) -> None:
        """Stop leading: every loop and action of the leader stops; the snapshot stays
        as it was until the next `apply_view`."""
        if not self._leading:
            return
        self._leading = False
        for rep in self._replicas.values():
            for t in rep.tasks:
                t.cancel()
            rep.tasks = []
            rep.action = None
            rep.verifying = False
        for d in self._domains.values():
            d.task = None
        self._discovery = None
        for task in list(self._background):
            if task is not self._lag_task:
                task.cancel()  # actions, verifications, cordons, DCGM, discovery

    def apply_view(self, view: PublishedView) -> None:
        """A follower takes the leader's view: the snapshot becomes it, and the records
        follow it (the admin API shows them, and a promotion carries on from them).
        Membership is the caller's: it adds and removes replicas first."""
        if self._leading:
            return
        for p in view.replicas:
            rep = self._replicas.get(p.spec.replica_id)
            if rep is None:
                continue
            try:
                rep.state = State(p.view.state)
            except ValueError:
                continue  # a state a newer leader knows and we do not: keep ours
            rep.reason = p.view.reason
            rep.held = p.view.held
            rep.load = p.view.load
            rep.no_metrics = p.view.no_metrics
            rep.restarts, rep.failures = p.restarts, p.failures
            rep.model = p.view.model or rep.model
            rep.signals = dataclasses.replace(
                rep.signals,
                started_at=p.started_at,
                verify_with_deep_probe=p.verify_with_deep_probe,
            )
        for name in set(view.cordons) | {d.name for d in self._domains.values() if d.cordoned}:
            d = self._domain(name)
            reasons = view.cordons.get(name)
            d.cordoned = reasons is not None
            if reasons is not None and (d.evidence is None or d.evidence.reasons != reasons):
                d.evidence = Evidence(name, reasons)
            elif reasons is None:
                d.evidence, d.since_wall = None, None
        self._snapshot = view.snapshot()
        for listener in self._listeners:
            listener(self._snapshot)

    def hold_view(self) -> None:
        """Fail-static: keep routing on the last view (states, holds, cordons, scores),
        but without its engine readings, which are now older than anything admission
        may act on: each load keeps only what does not change while a replica runs
        (its KV capacity and block size, so this instance's own KV reservations still
        bound what it admits), stamped now, and no saturation verdict drawn from old
        queues. Without this, a view older than admission's `metrics_max_age_s` would
        read as "metrics stale" on every replica and refuse all work."""
        if self._leading:
            return
        now = clock.monotonic()
        snap = self._snapshot
        held = {
            rid: dataclasses.replace(
                v, load=_static_load(v.load, now), saturated=False, saturation_reason=""
            )
            for rid, v in snap.replicas.items()
        }
        self._snapshot = FleetSnapshot(held, snap.taken_at, snap.cordoned)
        for listener in self._listeners:
            listener(self._snapshot)

    def export_view(
        self,
        leader: str,
        epoch: int,
        seq: int,
        published_wall: float,
        quotas: dict[str, Any] | None = None,
    ) -> PublishedView:
        """The leader's view, for the cluster to publish."""
        snap = self._snapshot
        replicas = tuple(
            PublishedReplica(
                spec=rep.spec,
                view=snap.replicas.get(rid) or self._view(rep),
                restarts=rep.restarts,
                failures=rep.failures,
                started_at=rep.signals.started_at,
                verify_with_deep_probe=rep.signals.verify_with_deep_probe,
            )
            for rid, rep in self._replicas.items()
        )
        cordons = {
            d.name: d.evidence.reasons if d.evidence and d.evidence.reasons else ("cordoned",)
            for d in self._domains.values()
            if d.cordoned
        }
        return PublishedView(
            leader, epoch, seq, published_wall, snap.taken_at, replicas, cordons, quotas or {}
        )

    # ---------------------------------------------------------------- operator actions

    def drain(self, replica_id: str, restart: bool = False) -> None:
        """Stop new work to the replica. `restart=True`: let in-flight work finish, then
        restart it (the state machine's drain); otherwise hold it out until `undrain`."""
        rep = self._replicas[replica_id]
        if restart:
            self._fire(rep, Event.drain_requested, "operator")
            return
        rep.held = True
        self._record(rep, "hold", rep.state, rep.state, "held out of routing by the operator")
        self._publish()

    def undrain(self, replica_id: str) -> None:
        rep = self._replicas[replica_id]
        rep.held = False
        self._record(rep, "release", rep.state, rep.state, "released by the operator")
        self._publish()

    def restart(self, replica_id: str, reason: str = "operator") -> None:
        self._fire(self._replicas[replica_id], Event.restart_requested, reason)

    async def cordon(self, node: str, reason: str = "operator") -> None:
        await self._cordon(node, (f"cordoned by {reason}",), ticket=False, event=Event.cordon)

    async def uncordon(self, node: str) -> None:
        d = self._domain(node)
        if not d.cordoned:
            return
        # The actuator first: the local supervisor refuses to start replicas in a
        # cordoned domain, and uncordon restarts them.
        await self.actuator.uncordon(node)
        # Also marks the time: the restarts before an uncordon no longer count.
        await self.ledger.set_cordoned(node, False)
        d.cordoned, d.since_wall, d.evidence, d.gpu = False, None, None, HEALTHY
        log.warning("node %s uncordoned", node)
        for rep in self._in_domain(node):
            self._fire(rep, Event.uncordon, "operator")
        self._publish()

    def notify_process_started(self, replica_id: str) -> None:
        """For actuators that start processes themselves (the local supervisor): the
        startup allowance of a starting replica runs from the real start."""
        rep = self._replicas.get(replica_id)
        if rep is not None:
            rep.signals = rules.on_process_started(rep.signals, rep.state, clock.monotonic())

    def notify_process_exited(
        self, replica_id: str, reason: str = "process exited", failure: bool = True
    ) -> None:
        """For actuators that see their processes die (the local supervisor). A clean
        exit (`failure=False`: status 0, e.g. someone sent SIGTERM) is restarted like any
        other but does not count towards cordoning the node: it says nothing of the GPU."""
        rep = self._replicas.get(replica_id)
        if rep is not None:
            self._fire(rep, Event.process_exited, reason, counts=failure)

    # ---------------------------------------------------------------- loops

    async def _lag_loop(self) -> None:
        """How late our own event loop runs (see `policy.replica_rules.LoopLag`)."""
        while True:
            due = clock.monotonic() + _LAG_SAMPLE_S
            self._lag.expect(due)
            await asyncio.sleep(_LAG_SAMPLE_S)
            self._lag.woke(due, clock.monotonic())

    def _probe(
        self, result: probes.ProbeResult, timeout_s: float, sent_at: float, now: float
    ) -> Probe:
        lag_s = self._lag.stalled_s(sent_at, now, now)
        return Probe(result.ok, result.error, result.latency_s, timeout_s, lag_s)

    async def _liveness_loop(self, rep: TrackedReplica) -> None:
        cfg = self.config
        while True:
            generation = rep.generation
            sent_at = clock.monotonic()
            result = await probes.liveness(
                self.session,
                rep.spec.url,
                cfg.liveness_timeout_s,
                cfg.liveness_path,
                self._auth(rep),
            )
            now = clock.monotonic()
            if generation == rep.generation and rep.state is not State.restarting:
                probe = self._probe(result, cfg.liveness_timeout_s, sent_at, now)
                self._apply(
                    rep, rules.on_liveness(rep.signals, rep.state, probe, now, self._th), False
                )
                # The score follows the gateway's own signals (TTFT, ITL, errors) each
                # second, for a replica without /metrics too (no scrape rescores it).
                self._rescore(rep)
                self._publish_if_changed(rep)
                self._check_progress(rep, now)
            await asyncio.sleep(cfg.liveness_interval_s)

    def _check_progress(self, rep: TrackedReplica, now: float) -> None:
        rid = rep.spec.replica_id
        rep.watchdog.observe_gateway(
            self.signals.streams_in_flight(rid), self.signals.chunks_relayed_total(rid), now
        )
        if rep.state in PROBED_STATES:
            fire = rules.on_progress_check(rep.state, rep.watchdog.stuck(now))
            if fire is not None:
                self._fire(rep, fire.event, fire.detail)

    async def _scrape_loop(self, rep: TrackedReplica) -> None:
        cfg = self.config
        while True:
            wait_s = cfg.scrape_interval_s
            if rep.spec.engine == "openai":
                rep.scrape_note = "no /metrics (openai engine): deep probe only"
                self._no_metrics(rep, True)
                return
            if rep.state not in (State.restarting, State.dead):
                generation = rep.generation
                text = await probes.scrape_text(
                    self.session, rep.spec.url, cfg.scrape_timeout_s, headers=self._auth(rep)
                )
                if generation == rep.generation:
                    if isinstance(text, probes.ScrapeError):
                        rep.scrape_note = f"scrape failed: {text.reason}"
                        if text.reason == "absent":
                            wait_s *= _ABSENT_BACKOFF
                            self._no_metrics(rep, True)
                    elif not self._on_scrape(rep, text, clock.monotonic()):
                        wait_s *= _ABSENT_BACKOFF
                    elif rep.slots is None and rep.adapter is not None:
                        await self._learn_slots(rep)
            await asyncio.sleep(wait_s)

    def _on_scrape(self, rep: TrackedReplica, text: str, now: float) -> bool:
        adapter = rep.adapter or self._resolve_adapter(rep.spec.engine, text)
        if adapter is None:
            rep.scrape_note = "unknown engine: no load view (set the replica's engine)"
            self._no_metrics(rep, True)
            return False
        rep.adapter = adapter
        rep.scrape_note = ""
        rep.no_metrics = False
        load = adapter.parse(text, scraped_at=now)
        if rep.slots:
            load = dataclasses.replace(load, slots=rep.slots)
        rep.load = load
        rep.watchdog.observe_engine(load.running, load.generation_tokens_total, now)
        before = after = rep.storm.state
        if load.preemptions_total is not None:
            after = rep.storm.observe(load.preemptions_total, now)
        step = rules.on_scrape(
            rep.signals, before, after, rep.storm.last_rate_per_s, load.waiting, self._th
        )
        self._apply(rep, step, publish=False)
        # Only this replica's load changed: rescoring and rebuilding the whole fleet's
        # views here made every scrape cost O(fleet), the fleet's scrapes O(fleet²) a
        # second. The others' scores follow their own scrapes, liveness probes and deep
        # probes (`bench_scrape.py --fleet`).
        self._rescore(rep)
        self._publish_if_changed(rep)
        return True

    async def _deep_loop(self, rep: TrackedReplica) -> None:
        rid = rep.spec.replica_id
        while True:
            busy = self.signals.streams_in_flight(rid) > 0 or bool(
                rep.load is not None and rep.load.running
            )
            delay = rules.deep_probe_delay_s(
                busy, self._th, self._rng.uniform(-1, 1), rep.spec.deep_probe_min_interval_s
            )
            await asyncio.sleep(delay)
            if rep.state not in PROBED_STATES:
                continue
            generation = rep.generation
            model = rep.model or rep.spec.model or await self._discover_model(rep)
            if not model:
                continue
            probe, progress = await self._deep_probe(rep, model)
            if generation != rep.generation or rep.state not in PROBED_STATES:
                continue
            step = rules.on_deep_probe(rep.signals, probe, progress, self._th)
            if step.verdict is Verdict.failed and self._export is not None:
                self._export.deep_probe_failed(rid)
            self._apply(rep, step, publish=False)
            self._rescore()
            self._publish()

    async def _deep_probe(self, rep: TrackedReplica, model: str) -> tuple[Probe, Progress]:
        """One deep probe, with what moved on the replica while it was out."""
        cfg = self.config
        rid = rep.spec.replica_id
        tokens_before = rep.load.generation_tokens_total if rep.load is not None else None
        chunks_before = self.signals.chunks_relayed_total(rid)
        sent_at = clock.monotonic()
        result = await probes.deep_probe(
            self.session,
            rep.spec.url,
            model,
            cfg.deep_probe_timeout_s,
            cfg.deep_probe_path,
            self._auth(rep),
        )
        now = clock.monotonic()
        tokens_after = rep.load.generation_tokens_total if rep.load is not None else None
        progress = Progress(
            engine_tokens_advanced=(
                tokens_before is not None
                and tokens_after is not None
                and tokens_after > tokens_before
            ),
            chunks_relayed_advanced=self.signals.chunks_relayed_total(rid) > chunks_before,
            waiting=rep.load.waiting if rep.load is not None else None,
        )
        return self._probe(result, cfg.deep_probe_timeout_s, sent_at, now), progress

    async def _verify(self, rep: TrackedReplica) -> None:
        """One deep probe before a replica that was not really restarted is readmitted."""
        try:
            generation = rep.generation
            model = rep.model or rep.spec.model or await self._discover_model(rep)
            probe, progress = await self._deep_probe(rep, model)
            if generation != rep.generation:
                return
            self._apply(
                rep, rules.on_verification(rep.signals, rep.state, probe, progress, self._th)
            )
        finally:
            rep.verifying = False

    async def _learn_slots(self, rep: TrackedReplica) -> None:
        """llama.cpp's slot count (`--parallel`), which its /metrics does not carry: GET
        /props once (`total_slots`). Other engines: nothing to learn (0: not asked again)."""
        if rep.adapter is None or rep.adapter.kind != EngineKind.LLAMACPP:
            rep.slots = 0
            return
        status, props = await self._get_json(rep, "/props", self.config.scrape_timeout_s)
        if status == 404:  # a build without /props: nothing to learn
            rep.slots = 0
        elif status == 200:  # otherwise asked again after the next scrape
            slots = props.get("total_slots") if isinstance(props, dict) else None
            rep.slots = slots if isinstance(slots, int) and slots > 0 else 0

    async def _get_json(self, rep: TrackedReplica, path: str, timeout_s: float) -> tuple[int, Any]:
        """GET `path` of the replica with its credential: (status, the JSON body or None);
        status 0 when it did not answer."""
        try:
            async with self.session.get(
                rep.spec.url.rstrip("/") + path,
                headers=self._auth(rep),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                body = orjson.loads(await resp.read()) if resp.status == 200 else None
                return resp.status, body
        except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError):
            return 0, None

    def _auth(self, rep: TrackedReplica) -> dict[str, str] | None:
        """The replica's credential as a header, as the request path sends it."""
        key = self._credentials(rep.spec.replica_id) if self._credentials else None
        return {"Authorization": f"Bearer {key}"} if key else None

    async def _discover_model(self, rep: TrackedReplica) -> str:
        _, data = await self._get_json(rep, "/v1/models", self.config.deep_probe_timeout_s)
        models = data.get("data") if isinstance(data, dict) else None
        if isinstance(models, list) and models and isinstance(models[0], dict):
            rep.model = str(models[0].get("id", ""))
        return rep.model

    async def _dcgm_loop(self, node: str, url: str) -> None:
        cfg = self.config
        d = self._domain(node)
        while True:
            text = await probes.scrape_text(self.session, url, cfg.dcgm_timeout_s, path="")
            if isinstance(text, str):
                sample = parse_dcgm(text)
                gpu = assess(sample, d.dcgm_previous)
                d.dcgm_previous = sample
                await self._on_gpu(d, gpu)
            await asyncio.sleep(cfg.dcgm_interval_s)

    async def _on_gpu(self, d: TrackedDomain, gpu: GpuHealth) -> None:
        if gpu.warnings and gpu.warnings != d.gpu.warnings:
            log.warning("node %s GPU warnings: %s", d.name, "; ".join(gpu.warnings))
        d.gpu = gpu
        if gpu.fatal:
            if not d.cordoned:
                await self._cordon(d.name, gpu.reasons, ticket=True, event=Event.hardware_fatal)
            return
        for why in gpu.restart_app:
            # An application-class Xid: the GPU is fine, the process on it is not.
            for rep in self._in_domain(d.name):
                self._fire(rep, Event.restart_requested, f"GPU application fault: {why}", True)
        self._rescore()
        self._publish()

    # ---------------------------------------------------------------- rules -> events

    def _apply(self, rep: TrackedReplica, step: Step, publish: bool = True) -> None:
        """Take a rule's answer: the new record, a note, the verification, the events."""
        rep.signals = step.signals
        if step.note is not None:
            rep.reason = step.note
        if step.verify and not rep.verifying:
            rep.verifying = True
            self._spawn(self._verify(rep))
        for fire in step.fire:
            self._fire(rep, fire.event, fire.detail)
        if publish:
            self._publish_if_changed(rep)

    def _fire(
        self, rep: TrackedReplica, event: Event, detail: str, counts: bool | None = None
    ) -> None:
        """Feed one edge event to the state machine and carry out the transition."""
        if self._replicas.get(rep.spec.replica_id) is not rep:
            return  # removed meanwhile
        if not self._leading:
            return  # a follower's states are the leader's (`apply_view`)
        t = health.step(rep.state, event)
        if t.actions == (Action.none,) and t.next is rep.state:
            return
        before = rep.state
        rep.state = t.next
        rep.reason = f"{t.reason}: {detail}" if detail else t.reason
        self._execute(rep, t, event, before, counts)
        if t.next is State.ready:
            again = rules.still_present(rep.signals, rep.storm.state)
            if again is not None:
                self._fire(rep, again.event, again.detail)
        self._publish()

    def _execute(
        self,
        rep: TrackedReplica,
        t: Transition,
        event: Event,
        before: State,
        counts: bool | None,
    ) -> None:
        """Carry out every action of transition `t`, in the table's order."""
        for action in t.actions:
            match action:
                case Action.none:
                    pass
                case Action.stop_routing:
                    # The new state is already set: the view that leaves routing goes
                    # out before any action below does I/O.
                    self._publish()
                case Action.drain:
                    # Into `draining` the drain ends in `drained` -> restart; into
                    # `cordoned` the same wait lets in-flight work finish, and `drained`
                    # is ignored there (nothing restarts on a cordoned domain).
                    self._act(rep, "drain", self._drain(rep))
                case Action.restart:
                    failure = rules.counts_as_failure(event, counts)
                    self._act(rep, "restart", self._restart(rep, rep.reason, failure))
                case Action.cordon_node:
                    if not self._domain(rep.spec.domain).cordoned:
                        # Cordons are usually started by `_cordon`, which marks the domain
                        # first; an event that reaches this row otherwise still cordons.
                        self._spawn(
                            self._cordon(rep.spec.domain, (rep.reason,), True, Event.cordon)
                        )
                case Action.record:
                    self._record(rep, event.value, before, t.next, rep.reason)
                case _:
                    assert_never(action)

    def _record(
        self, rep: TrackedReplica, event: str, before: State, after: State, why: str
    ) -> None:
        now = clock.monotonic()
        self._history.append(
            TransitionRecord(
                now, clock.wall(), rep.spec.replica_id, event, before.value, after.value, why
            )
        )
        if before is not after:
            level = logging.INFO if after in (State.ready, State.starting) else logging.WARNING
            log.log(level, "replica %s: %s -> %s (%s)", rep.spec.replica_id, before, after, why)

    # ---------------------------------------------------------------- actions

    def _act(self, rep: TrackedReplica, kind: str, coro: Coroutine[Any, Any, None]) -> None:
        """One action at a time per replica. A restart overrides a drain in progress (the
        replica failed while draining); anything else waits for the current action."""
        current = rep.action
        if current is not None and not current.done():
            if not (kind == "restart" and rep.action_kind == "drain"):
                coro.close()
                return
            current.cancel()
        rep.action_kind = kind
        rep.action = self._spawn(coro)

    async def _drain(self, rep: TrackedReplica) -> None:
        """Wait until the gateway has nothing in flight on the replica (every request,
        streamed or not), up to `drain_timeout_s`, then report `drained`."""
        deadline = clock.monotonic() + self.config.drain_timeout_s
        left = await self.signals.wait_idle(rep.spec.replica_id, deadline)
        rep.action = None  # the restart that follows is the next action
        self._fire(rep, Event.drained, f"{left} requests left")

    async def _restart(self, rep: TrackedReplica, reason: str, failure: bool) -> None:
        spec = rep.spec
        rep.generation += 1
        try:
            restarted = bool(await self.actuator.restart(spec.ref(rep.model), reason))
        except Exception as exc:  # the replica is back to `starting`; the allowance rules
            log.error("restart of %s failed: %r", spec.replica_id, exc)
            restarted = False
        kind = rules.ledger_entry(failure, restarted)
        if restarted:
            rep.restarts += 1
            if self._export is not None:
                self._export.restarted(spec.domain, reason)
        elif failure:
            rep.failures += 1
        if kind is not None:
            try:
                await self.ledger.record(
                    RestartRecord(spec.domain, spec.replica_id, reason, clock.wall(), kind)
                )
            except LedgerError as e:  # the restart stands; only its row is lost
                log.error("restart of %s not recorded: %s", spec.replica_id, e)
        self._reset(rep, verify=rules.needs_verification(failure, restarted))
        rep.action = None
        self._fire(rep, Event.restarted, reason)
        if kind is RecordKind.restart:
            await self._maybe_cordon(spec.domain)

    async def _counted_restarts(self, domain: str, now_wall: float) -> list[RestartRecord]:
        """The restarts that count towards a cordon: within the window, after the last
        uncordon."""
        since = now_wall - self.config.restart_window_s
        uncordoned_at = await self.ledger.uncordoned_at(domain)
        recent = await self.ledger.restarts(domain, since)
        return [r for r in recent if uncordoned_at is None or r.at_wall > uncordoned_at]

    async def _maybe_cordon(self, domain: str) -> None:
        cfg = self.config
        now_wall = clock.wall()
        try:
            counted = await self._counted_restarts(domain, now_wall)
        except LedgerError as e:
            log.error("cannot count the restarts of %s: %s", domain, e)
            return
        if self._domain(domain).cordoned:
            return
        times = [r.at_wall for r in counted]
        if should_cordon(times, now_wall, cfg.restart_limit, cfg.restart_window_s):
            why = f"{len(times)} restarts within {cfg.restart_window_s:g} s"
            await self._cordon(domain, (why,), ticket=True, event=Event.cordon)

    async def _cordon(
        self, domain: str, reasons: tuple[str, ...], ticket: bool, event: Event
    ) -> None:
        d = self._domain(domain)
        if d.cordoned:
            return
        d.cordoned = True  # first, so that concurrent signals do not cordon twice
        d.since_wall = clock.wall()
        # Routing first: the replicas leave it before any I/O below.
        for rep in self._in_domain(domain):
            self._fire(rep, event, "; ".join(reasons))
        self._publish()
        try:
            counted = await self._counted_restarts(domain, d.since_wall)
        except LedgerError:
            counted = []
        gpu = {"gpu_fatal": "; ".join(d.gpu.reasons)} if d.gpu.fatal else {}
        evidence = Evidence(
            node=domain,
            reasons=reasons,
            restarts=tuple((r.at_wall, r.replica_id, r.reason) for r in counted),
            extra=gpu,
        )
        d.evidence = evidence
        try:
            await self.ledger.set_cordoned(domain, True, evidence)
        except LedgerError as e:  # the cordon stands here; a successor may not know it
            log.error("cordon of %s not recorded: %s", domain, e)
        log.warning("node %s cordoned: %s", domain, "; ".join(reasons))
        try:
            await self.actuator.cordon(domain, evidence)
        except Exception as exc:
            log.error("actuator could not cordon node %s: %r", domain, exc)
        if ticket:
            await self._tickets.open(self.session, evidence)
        self._publish()

    # ---------------------------------------------------------------- publishing

    def _rescore(self, only: TrackedReplica | None = None) -> None:
        """Every replica's health score against the fleet's medians; with `only`, that
        replica's alone, against the medians of the last `MEDIANS_TTL_S` (recomputed when
        older, or when the fleet's size changed; a full rescore always recomputes them)."""
        now = clock.monotonic()
        medians = self._medians
        observed: dict[str, Observed] = {}
        if (
            only is None
            or medians is None
            or now - medians.at >= MEDIANS_TTL_S
            or medians.size != len(self._replicas)
        ):
            reps = list(self._replicas.values())
            observed = {r.spec.replica_id: self.signals.observed(r.spec.replica_id) for r in reps}
            medians = self._medians = _Medians(
                at=now,
                size=len(reps),
                probe=_median(r.signals.deep_latency_s for r in reps),
                ttft=_median(o.ttft_p50_s for o in observed.values()),
                itl=_median(o.itl_p50_s for o in observed.values()),
            )
        probe_median, ttft_median, itl_median = medians.probe, medians.ttft, medians.itl
        for rep in self._replicas.values() if only is None else (only,):
            rid = rep.spec.replica_id
            seen = observed.get(rid)
            if seen is None:
                seen = self.signals.observed(rid)
            load = rep.load
            rep.breakdown = self._score.score(
                ScoreInputs(
                    deep_probe_success_ratio=rep.signals.deep_success_ratio,
                    deep_probe_latency_s=rep.signals.deep_latency_s,
                    fleet_median_deep_probe_latency_s=probe_median,
                    kv_usage=load.kv_usage if load else None,
                    waiting=load.waiting if load else None,
                    preemption_rate_per_s=rep.storm.last_rate_per_s,
                    ttft_s=seen.ttft_p50_s,
                    fleet_median_ttft_s=ttft_median,
                    itl_s=seen.itl_p50_s,
                    fleet_median_itl_s=itl_median,
                    error_rate=seen.error_rate,
                    hardware_fault=self._domain(rep.spec.domain).gpu.fatal,
                )
            )

    def _view(self, rep: TrackedReplica) -> ReplicaView:
        breakdown = rep.breakdown
        load = rep.load
        decided = rules.routing(
            rep.state,
            rep.signals,
            rep.reason,
            held=rep.held,
            cordoned=self._domain(rep.spec.domain).cordoned,
            health_score=breakdown.total if breakdown else 1.0,
            waiting=load.waiting if load is not None else None,
            th=self._th,
        )
        return ReplicaView(
            replica_id=rep.spec.replica_id,
            url=rep.spec.url,
            model=rep.model or rep.spec.model,
            node=rep.spec.domain,
            routable=decided.routable,
            state=rep.state.value,
            reason=decided.reason,
            score=decided.score,
            load=load,
            saturated=decided.saturated,
            saturation_reason=decided.saturation_reason,
            held=rep.held,
            engine=rep.adapter.kind.value if rep.adapter else _configured_engine(rep.spec.engine),
            no_metrics=rep.no_metrics,
            health_score=breakdown.total if breakdown else None,
            score_parts=tuple(breakdown.factors().items()) if breakdown else (),
        )

    def _publish_if_changed(self, rep: TrackedReplica) -> None:
        """Publish when this replica's view changed: its view built, the others' kept
        (every other change publishes the fleet's itself)."""
        if not self._leading:
            return
        rid = rep.spec.replica_id
        snap = self._snapshot
        if (
            rid not in snap.replicas
            or self._replicas.get(rid) is not rep
            or self._domain(rep.spec.domain).cordoned != (rep.spec.domain in snap.cordoned)
        ):
            # Not in the snapshot yet, no longer watched, or its node's cordon changed
            # (every replica on the node changes with it): the fleet's views.
            self._publish()
            return
        view = self._view(rep)
        if view != snap.replicas[rid]:
            self._emit(
                FleetSnapshot({**snap.replicas, rid: view}, clock.monotonic(), snap.cordoned)
            )

    def _no_metrics(self, rep: TrackedReplica, value: bool) -> None:
        if rep.no_metrics != value:
            rep.no_metrics = value
            self._publish()

    def _publish(self, force: bool = False) -> None:
        if not self._leading:
            return  # a follower's snapshot is the leader's view (`apply_view`)
        snap = self._snapshot
        views: dict[str, ReplicaView] = {}
        changed = len(self._replicas) != len(snap.replicas)
        for rid, rep in self._replicas.items():
            view = self._view(rep)
            old = snap.replicas.get(rid)
            if view == old:
                view = old  # the same object: listeners pass over replicas it names
            else:
                changed = True
            views[rid] = view
        cordoned = frozenset(d.name for d in self._domains.values() if d.cordoned)
        if not (force or changed or cordoned != snap.cordoned):
            return
        self._emit(FleetSnapshot(views, clock.monotonic(), cordoned))

    def _emit(self, snap: FleetSnapshot) -> None:
        """A replica whose view did not change keeps its view object
        (`FleetSnapshot.changed_since`)."""
        self._snapshot = snap
        for listener in self._listeners:
            listener(snap)

    # ---------------------------------------------------------------- helpers

    def _new_replica(self, spec: ReplicaSpec) -> TrackedReplica:
        return TrackedReplica(
            spec=spec,
            signals=rules.fresh(clock.monotonic()),
            watchdog=ProgressWatchdog(self.config.watchdog_window_s),
            storm=self._new_storm(),
            model=spec.model,
        )

    def _new_storm(self) -> StormDetector:
        cfg = self.config
        return StormDetector(cfg.storm_rate_threshold_per_s, cfg.storm_sustain_s, cfg.storm_clear_s)

    def _reset(self, rep: TrackedReplica, verify: bool) -> None:
        """A restarted replica starts from nothing: no evidence carries over."""
        rep.signals = rules.restarted(rep.signals, clock.monotonic(), verify)
        rep.watchdog = ProgressWatchdog(self.config.watchdog_window_s)
        rep.storm = self._new_storm()
        rep.load, rep.breakdown = None, None

    def _resolve_adapter(self, engine: str, text: str) -> Adapter | None:
        detected = detect_engine(text)
        if engine in ("auto", "vllm"):
            if engine == "vllm" and detected not in (EngineKind.VLLM, EngineKind.VLLM_LEGACY):
                return adapter_for(EngineKind.VLLM)
            return adapter_for(detected) if detected is not None else None
        return adapter_for(engine)

    def _domain(self, name: str) -> TrackedDomain:
        d = self._domains.get(name)
        if d is None:
            d = self._domains[name] = TrackedDomain(name)
        return d

    def _in_domain(self, domain: str) -> list[TrackedReplica]:
        return [r for r in self._replicas.values() if r.spec.domain == domain]

    def _spawn(self, coro: Coroutine[Any, Any, None], keep: bool = True) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        if keep:
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_crash)
        return task


def _thresholds(cfg: FleetMonitorConfig) -> rules.Thresholds:
    return rules.Thresholds(
        startup_allowance_s=cfg.startup_allowance_s,
        liveness_failures_threshold=cfg.liveness_failures_threshold,
        deep_probe_failures_threshold=cfg.deep_probe_failures_threshold,
        deep_probe_window=cfg.deep_probe_window,
        ready_waiting_threshold=cfg.ready_waiting_threshold,
        deep_probe_interval_s=cfg.deep_probe_interval_s,
        deep_probe_idle_interval_s=cfg.deep_probe_idle_interval_s,
        deep_probe_jitter=cfg.deep_probe_jitter,
        lag_spoils_fraction=cfg.probe_lag_spoils_fraction,
    )


def _static_load(load: EngineLoad | None, now: float) -> EngineLoad | None:
    if load is None:
        return None
    return EngineLoad(
        kv_capacity_tokens=load.kv_capacity_tokens,
        kv_block_size=load.kv_block_size,
        slots=load.slots,
        scraped_at=now,
    )


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("fleet monitor task failed", exc_info=task.exception())


@dataclasses.dataclass(frozen=True, slots=True)
class _Medians:
    """The fleet's medians a score is judged against, and when they were computed."""

    at: float  # monotonic seconds
    size: int  # the fleet's size then
    probe: float | None
    ttft: float | None
    itl: float | None


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _spec_from(endpoint: Endpoint, model: str, engine: str) -> ReplicaSpec:
    # Without a node name (DNS discovery) each replica is its own failure domain: pod
    # IPs change on restart, and the replicas may share no hardware at all.
    return ReplicaSpec(
        endpoint.replica_id,
        endpoint.url,
        model,
        endpoint.node or None,
        engine,
        pod=endpoint.pod,
        namespace=endpoint.namespace,
        uid=endpoint.uid,
    )


def replica_specs(replicas: Sequence[Any]) -> list[ReplicaSpec]:
    """`ReplicaSpec`s from the gateway config's `replicas:` (`seawall.config.ReplicaConfig`),
    with the same default ids the gateway uses ("r<index>")."""
    return [
        ReplicaSpec(
            replica_id=r.id or f"r{i}",
            url=r.url,
            model=r.model or "",
            node=r.node,
            engine=r.engine,
        )
        for i, r in enumerate(replicas)
    ]


__all__ = [
    "FleetMonitor",
    "GatewaySignals",
    "NoGatewaySignals",
    "Observed",
    "ReplicaSpec",
    "TransitionRecord",
    "replica_specs",
]


def _configured_engine(engine: str) -> str:
    return "" if engine == "auto" else engine
