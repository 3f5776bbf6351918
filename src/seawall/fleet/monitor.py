"""The fleet monitor: probes every replica off the request path, decides, acts, publishes.

Owns the I/O around the pure policies in `seawall.policy`: per replica a liveness loop
(GET /health, with the startup allowance), a scrape loop (/metrics through the engine
adapter, feeding the progress watchdog, the storm detector and the health score), a
deep-probe loop (one real token, jittered, idle replicas more often), and per node an
optional DCGM loop. Every signal becomes an edge event for the state machine
(`seawall.policy.health.step`); the transition's actions are carried out here through
the `Actuator` (drain -> restart -> record in the ledger; K restarts on a node within
the window -> cordon + hardware ticket). After each change a new immutable
`FleetSnapshot` is swapped in: `snapshot()` is an attribute read.

Must not: sit on the request path (the gateway reads `snapshot()` and never awaits the
monitor), make decisions that belong to the policies (thresholds are counted here, the
rules live there), or read time other than through `seawall.clock`.

Routing rule published in each `ReplicaView`: routable when the state routes
(`health.routable`), the last liveness probe passed (one failure is enough to stop
sending new work: it is cheap to be wrong for a second), no operator hold, and the node
is not cordoned. `score` is the health score times the state's routing weight, so a
degraded replica gets a quarter of the share it would get by its score alone.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from seawall import clock
from seawall.actuate.base import Actuator, Evidence, NoActuator, ReplicaRef
from seawall.fleet import probes
from seawall.fleet.adapters import Adapter, EngineKind, adapter_for, detect_engine
from seawall.fleet.config import FleetMonitorConfig
from seawall.fleet.discovery import Discovery, Endpoint, watch
from seawall.fleet.gpu import HEALTHY, DcgmSample, GpuHealth, assess, parse_dcgm
from seawall.fleet.signals import (
    GatewaySignals,
    NoGatewaySignals,
    Observed,
)
from seawall.fleet.view import EngineLoad, FleetSnapshot, ReplicaView
from seawall.metrics import Metrics
from seawall.policy import health
from seawall.policy.health import Action, Event, State
from seawall.policy.ledger import RestartRecord, should_cordon
from seawall.policy.score import HealthScore, ScoreBreakdown, ScoreInputs
from seawall.policy.storm import StormDetector, StormState
from seawall.policy.watchdog import ProgressWatchdog
from seawall.state.ledger import RestartLedger

log = logging.getLogger(__name__)

# Restarts caused by a failure count towards cordoning the node; an operator's restart,
# an uncordon and the end of a requested drain do not: they say nothing about hardware.
_FAILURE_EVENTS = frozenset(
    {
        Event.health_failed,
        Event.startup_timeout,
        Event.deep_probe_failed_n,
        Event.stuck,
        Event.process_exited,
    }
)
_PROBED_STATES = frozenset({State.ready, State.degraded, State.draining})
# Scrapes that found no /metrics (plain OpenAI servers) or an unknown engine are retried
# this many intervals apart: the answer rarely changes and the deep probe decides anyway.
_ABSENT_BACKOFF = 10


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One replica to monitor. `model=""` asks GET /v1/models once."""

    replica_id: str
    url: str
    model: str = ""
    node: str = "local"
    engine: str = "auto"  # auto | vllm | vllm_legacy | sglang | tgi | llamacpp | openai
    pod: str | None = None
    namespace: str | None = None

    def ref(self, model: str = "") -> ReplicaRef:
        return ReplicaRef(
            self.replica_id, self.url, self.node, model or self.model, self.pod, self.namespace
        )


@dataclass(frozen=True, slots=True)
class TransitionRecord:
    """One state change, kept for `describe()` (the admin API shows the last few)."""

    at: float  # monotonic seconds
    at_wall: float  # unix seconds, for people
    replica_id: str
    event: str
    before: str
    after: str
    reason: str


@dataclass(eq=False)
class _Replica:
    spec: ReplicaSpec
    started_at: float
    watchdog: ProgressWatchdog
    storm: StormDetector
    deep_results: deque[bool]
    state: State = State.starting
    reason: str = "started; waiting for the first healthy probe"
    model: str = ""
    held: bool = False  # operator drain without restart
    adapter: Adapter | None = None
    scrape_note: str = ""
    load: EngineLoad | None = None
    liveness_probes: int = 0
    liveness_failures: int = 0
    liveness_error: str = ""
    deep_streak: int = 0
    deep_reported: bool = False  # a failure streak was reported and not yet recovered
    deep_latency_s: float | None = None
    over_waiting: bool = False
    breakdown: ScoreBreakdown | None = None
    restarts: int = 0
    generation: int = 0  # bumped on restart: results from before are discarded
    action: asyncio.Task[None] | None = None
    action_kind: str = ""
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # After a failure restart that restarted nothing (actuator `none`), a passing /health
    # proves nothing: a hung engine answers it. Readmit only after a real token.
    verify_with_deep_probe: bool = False
    verifying: bool = False


@dataclass(eq=False)
class _Node:
    name: str
    cordoned: bool = False
    since_wall: float | None = None
    evidence: Evidence | None = None
    gpu: GpuHealth = HEALTHY
    dcgm_previous: DcgmSample | None = None
    task: asyncio.Task[None] | None = None


class FleetMonitor:
    """Watches replicas and keeps `snapshot()` true. See the module docstring."""

    def __init__(
        self,
        config: FleetMonitorConfig,
        replicas: Iterable[ReplicaSpec] = (),
        *,
        actuator: Actuator | None = None,
        metrics: Metrics | None = None,
        signals: GatewaySignals | None = None,
        ledger: RestartLedger | None = None,
        session: aiohttp.ClientSession | None = None,
        score: HealthScore | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.actuator: Actuator = actuator or NoActuator()
        self.metrics = metrics
        self.signals: GatewaySignals = signals or NoGatewaySignals()
        self._ledger = ledger
        self._owns_ledger = ledger is None
        self._session = session
        self._owns_session = session is None
        self._score = score or HealthScore()
        self._rng = rng or random.Random()
        self._replicas: dict[str, _Replica] = {}
        self._nodes: dict[str, _Node] = {}
        self._snapshot = FleetSnapshot()
        self._listeners: list[Callable[[FleetSnapshot], None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._history: deque[TransitionRecord] = deque(maxlen=50)
        self._running = False
        self._pending = list(replicas)

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        if self._ledger is None:
            self._ledger = RestartLedger(self.config.ledger_path)
        if self._session is None:
            self._session = aiohttp.ClientSession()
        # Cordons outlive the monitor: a node cordoned before a redeploy stays cordoned,
        # and its replicas are never routable in between.
        for node, record in (await self.ledger.cordoned_nodes()).items():
            n = self._node(node)
            n.cordoned, n.since_wall, n.evidence = True, record.since_wall, record.evidence
            if self.metrics is not None:
                self.metrics.node_cordoned.labels(node).set(1)
            # The actuator must know too: a local supervisor would otherwise restart
            # replicas on a node the ledger says is cordoned.
            await self.actuator.cordon(node, record.evidence or Evidence(node, ("restored",)))
        pending, self._pending = self._pending, []
        for spec in pending:
            self.add_replica(spec)
        for node, url in self.config.dcgm.items():
            self._node(node).task = self._spawn(self._dcgm_loop(node, url))
        self._publish()

    async def stop(self) -> None:
        """Cancel every loop and action; close what the monitor opened itself."""
        self._running = False
        tasks = [t for rep in self._replicas.values() for t in rep.tasks]
        tasks += [n.task for n in self._nodes.values() if n.task is not None]
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
    def ledger(self) -> RestartLedger:
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
        """What the admin API serves: every replica and node, with the why."""
        now = clock.monotonic()
        replicas = []
        for rep in self._replicas.values():
            view = self._snapshot.replicas.get(rep.spec.replica_id)
            ratio = _ratio(rep.deep_results)
            replicas.append(
                {
                    "id": rep.spec.replica_id,
                    "url": rep.spec.url,
                    "model": rep.model or rep.spec.model,
                    "node": rep.spec.node,
                    "engine": rep.adapter.kind.value if rep.adapter else rep.spec.engine,
                    "state": rep.state.value,
                    "reason": rep.reason,
                    "routable": view.routable if view else False,
                    "held": rep.held,
                    "saturated": view.saturated if view else False,
                    "score": rep.breakdown.total if rep.breakdown else 1.0,
                    "routing_score": view.score if view else 0.0,
                    "score_parts": rep.breakdown.factors() if rep.breakdown else {},
                    "load": _load_dict(rep.load),
                    "scrape": rep.scrape_note,
                    "in_flight": self.signals.streams_in_flight(rep.spec.replica_id),
                    "restarts": rep.restarts,
                    "liveness": {
                        "probes": rep.liveness_probes,
                        "consecutive_failures": rep.liveness_failures,
                        "last_error": rep.liveness_error,
                    },
                    "deep_probe": {
                        "success_ratio": ratio,
                        "latency_s": rep.deep_latency_s,
                        "consecutive_failures": rep.deep_streak,
                    },
                    "storm": rep.storm.state.value,
                    "preemption_rate_per_s": rep.storm.last_rate_per_s,
                    "up_for_s": now - rep.started_at,
                }
            )
        nodes = [
            {
                "node": n.name,
                "cordoned": n.cordoned,
                "since_wall": n.since_wall,
                "evidence": list(n.evidence.reasons) if n.evidence else [],
                "restarts": [list(r) for r in n.evidence.restarts] if n.evidence else [],
                "gpu": {
                    "fatal": n.gpu.fatal,
                    "reasons": list(n.gpu.reasons),
                    "warnings": list(n.gpu.warnings),
                },
            }
            for n in self._nodes.values()
        ]
        history = [
            {
                "at": t.at,
                "at_wall": t.at_wall,
                "replica": t.replica_id,
                "event": t.event,
                "from": t.before,
                "to": t.after,
                "reason": t.reason,
            }
            for t in self._history
        ]
        return {"replicas": replicas, "nodes": nodes, "transitions": history}

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
        node = self._node(spec.node)
        rep.tasks = [
            self._spawn(self._liveness_loop(rep), keep=False),
            self._spawn(self._scrape_loop(rep), keep=False),
            self._spawn(self._deep_loop(rep), keep=False),
        ]
        if node.cordoned:
            self._fire(rep, Event.cordon, "node is cordoned (kept in the ledger)")
        self._publish()

    def remove_replica(self, replica_id: str) -> None:
        rep = self._replicas.pop(replica_id, None)
        if rep is None:
            return
        for t in rep.tasks:
            t.cancel()
        if rep.action is not None:
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

        self._spawn(watch(discovery, interval_s, changed, stop))

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
        n = self._node(node)
        if not n.cordoned:
            return
        # The actuator first: the local supervisor refuses to start replicas on a
        # cordoned node, and uncordon restarts them.
        await self.actuator.uncordon(node)
        await self.ledger.set_cordoned(node, False)
        n.cordoned, n.since_wall, n.evidence, n.gpu = False, None, None, HEALTHY
        if self.metrics is not None:
            self.metrics.node_cordoned.labels(node).set(0)
        log.warning("node %s uncordoned", node)
        for rep in self._on_node(node):
            self._fire(rep, Event.uncordon, "operator")
        self._publish()

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

    async def _liveness_loop(self, rep: _Replica) -> None:
        cfg = self.config
        while True:
            generation = rep.generation
            result = await probes.liveness(self.session, rep.spec.url, cfg.liveness_timeout_s)
            now = clock.monotonic()
            if generation == rep.generation and rep.state is not State.restarting:
                self._on_liveness(rep, result, now)
                self._check_progress(rep, now)
            await asyncio.sleep(cfg.liveness_interval_s)

    def _on_liveness(self, rep: _Replica, result: probes.ProbeResult, now: float) -> None:
        rep.liveness_probes += 1
        if rep.state is State.starting:
            if result.ok:
                rep.liveness_failures, rep.liveness_error = 0, ""
                if rep.verify_with_deep_probe:
                    if not rep.verifying:
                        rep.verifying = True
                        self._spawn(self._verify(rep))
                    return
                self._fire(rep, Event.health_ok, "")
                return
            # Failures while loading are expected: shown, not counted.
            rep.liveness_error = result.error
            if now - rep.started_at > self.config.startup_allowance_s:
                self._fire(
                    rep,
                    Event.startup_timeout,
                    f"not healthy after {self.config.startup_allowance_s:g} s "
                    f"(last: {result.error})",
                )
            return
        if result.ok:
            if rep.liveness_failures:
                rep.liveness_failures, rep.liveness_error = 0, ""
                self._publish()
            return
        rep.liveness_failures += 1
        rep.liveness_error = result.error
        if rep.liveness_failures >= self.config.liveness_failures_threshold:
            self._fire(
                rep,
                Event.health_failed,
                f"liveness failed {rep.liveness_failures} times in a row ({result.error})",
            )
        else:
            self._publish()  # one failure already stops routing (see the module doc)

    def _check_progress(self, rep: _Replica, now: float) -> None:
        rid = rep.spec.replica_id
        rep.watchdog.observe_gateway(
            self.signals.streams_in_flight(rid), self.signals.chunks_relayed_total(rid), now
        )
        if rep.state in _PROBED_STATES:
            stuck = rep.watchdog.stuck(now)
            if stuck is not None:
                self._fire(rep, Event.stuck, stuck)

    async def _scrape_loop(self, rep: _Replica) -> None:
        cfg = self.config
        while True:
            wait_s = cfg.scrape_interval_s
            if rep.spec.engine == "openai":
                rep.scrape_note = "no /metrics (openai engine): deep probe only"
                return
            if rep.state not in (State.restarting, State.dead):
                generation = rep.generation
                text = await probes.scrape_text(self.session, rep.spec.url, cfg.scrape_timeout_s)
                if generation == rep.generation:
                    if isinstance(text, probes.ScrapeError):
                        rep.scrape_note = f"scrape failed: {text.reason}"
                        if text.reason == "absent":
                            wait_s *= _ABSENT_BACKOFF
                    elif not self._on_scrape(rep, text, clock.monotonic()):
                        wait_s *= _ABSENT_BACKOFF
            await asyncio.sleep(wait_s)

    def _on_scrape(self, rep: _Replica, text: str, now: float) -> bool:
        adapter = rep.adapter or self._resolve_adapter(rep.spec.engine, text)
        if adapter is None:
            rep.scrape_note = "unknown engine: no load view (set the replica's engine)"
            return False
        rep.adapter = adapter
        rep.scrape_note = ""
        load = adapter.parse(text, scraped_at=now)
        rep.load = load
        rep.watchdog.observe_engine(load.running, load.generation_tokens_total, now)
        if load.preemptions_total is not None:
            before = rep.storm.state
            after = rep.storm.observe(load.preemptions_total, now)
            if before is StormState.calm and after is StormState.storm:
                rate = rep.storm.last_rate_per_s or 0.0
                self._fire(rep, Event.storm, f"preemptions at {rate:.1f}/s")
            elif before is StormState.storm and after is StormState.calm:
                self._fire(rep, Event.storm_cleared, "")
        if load.waiting is not None:
            over = load.waiting > self.config.ready_waiting_threshold
            if over and not rep.over_waiting:
                rep.over_waiting = True
                self._fire(rep, Event.not_ready, f"{load.waiting:g} waiting")
            elif not over and rep.over_waiting:
                rep.over_waiting = False
                self._fire(rep, Event.ready_again, "")
        self._rescore()
        self._publish()
        return True

    async def _deep_loop(self, rep: _Replica) -> None:
        cfg = self.config
        while True:
            busy = self.signals.streams_in_flight(rep.spec.replica_id) > 0 or bool(
                rep.load is not None and rep.load.running
            )
            base_s = cfg.deep_probe_interval_s if busy else cfg.deep_probe_idle_interval_s
            jitter = 1.0 + self._rng.uniform(-cfg.deep_probe_jitter, cfg.deep_probe_jitter)
            await asyncio.sleep(base_s * jitter)
            if rep.state not in _PROBED_STATES:
                continue
            generation = rep.generation
            model = rep.model or rep.spec.model or await self._discover_model(rep)
            if not model:
                continue
            result = await probes.deep_probe(
                self.session, rep.spec.url, model, cfg.deep_probe_timeout_s, cfg.deep_probe_path
            )
            if generation != rep.generation or rep.state not in _PROBED_STATES:
                continue
            self._on_deep_probe(rep, result)

    async def _verify(self, rep: _Replica) -> None:
        """One deep probe before a replica that was not really restarted is readmitted."""
        try:
            generation = rep.generation
            model = rep.model or rep.spec.model or await self._discover_model(rep)
            result = await probes.deep_probe(
                self.session,
                rep.spec.url,
                model,
                self.config.deep_probe_timeout_s,
                self.config.deep_probe_path,
            )
            if generation != rep.generation or rep.state is not State.starting:
                return
            if result.ok:
                rep.verify_with_deep_probe = False
                self._fire(rep, Event.health_ok, "a deep probe produced a token again")
            else:
                rep.reason = f"healthy but still not producing tokens ({result.error})"
                self._publish()
        finally:
            rep.verifying = False

    def _on_deep_probe(self, rep: _Replica, result: probes.ProbeResult) -> None:
        rep.deep_results.append(result.ok)
        if result.ok:
            rep.deep_latency_s = result.latency_s
            rep.deep_streak = 0
            if rep.deep_reported:
                rep.deep_reported = False
                self._fire(rep, Event.deep_probe_ok, "")
        else:
            if self.metrics is not None:
                self.metrics.deep_probe_failures.labels(rep.spec.replica_id).inc()
            rep.deep_streak += 1
            if rep.deep_streak >= self.config.deep_probe_failures_threshold:
                rep.deep_streak = 0
                rep.deep_reported = True
                self._fire(
                    rep,
                    Event.deep_probe_failed_n,
                    f"{self.config.deep_probe_failures_threshold} deep probes failed "
                    f"in a row ({result.error})",
                )
        self._rescore()
        self._publish()

    async def _discover_model(self, rep: _Replica) -> str:
        try:
            async with self.session.get(
                rep.spec.url.rstrip("/") + "/v1/models",
                timeout=aiohttp.ClientTimeout(total=self.config.deep_probe_timeout_s),
            ) as resp:
                data = orjson.loads(await resp.read()) if resp.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
            return ""
        models = data.get("data") if isinstance(data, dict) else None
        if isinstance(models, list) and models and isinstance(models[0], dict):
            rep.model = str(models[0].get("id", ""))
        return rep.model

    async def _dcgm_loop(self, node: str, url: str) -> None:
        cfg = self.config
        n = self._node(node)
        while True:
            text = await probes.scrape_text(self.session, url, cfg.dcgm_timeout_s, path="")
            if isinstance(text, str):
                sample = parse_dcgm(text)
                gpu = assess(sample, n.dcgm_previous)
                n.dcgm_previous = sample
                await self._on_gpu(n, gpu)
            await asyncio.sleep(cfg.dcgm_interval_s)

    async def _on_gpu(self, n: _Node, gpu: GpuHealth) -> None:
        if gpu.warnings and gpu.warnings != n.gpu.warnings:
            log.warning("node %s GPU warnings: %s", n.name, "; ".join(gpu.warnings))
        n.gpu = gpu
        if gpu.fatal:
            if not n.cordoned:
                await self._cordon(n.name, gpu.reasons, ticket=True, event=Event.hardware_fatal)
            return
        for why in gpu.restart_app:
            # An application-class Xid: the GPU is fine, the process on it is not.
            for rep in self._on_node(n.name):
                self._fire(rep, Event.restart_requested, f"GPU application fault: {why}", True)
        self._rescore()
        self._publish()

    # ---------------------------------------------------------------- transitions

    def _fire(self, rep: _Replica, event: Event, detail: str, counts: bool | None = None) -> None:
        """Feed one edge event to the state machine and carry out the transition."""
        if self._replicas.get(rep.spec.replica_id) is not rep:
            return  # removed meanwhile
        t = health.step(rep.state, event)
        if t.actions == (Action.none,) and t.next is rep.state:
            return
        before = rep.state
        rep.state = t.next
        rep.reason = f"{t.reason}: {detail}" if detail else t.reason
        self._record(rep, event.value, before, t.next, rep.reason)
        for action in t.actions:
            if action is Action.restart:
                failure = event in _FAILURE_EVENTS if counts is None else counts
                self._act(rep, "restart", self._restart(rep, rep.reason, failure))
            elif action is Action.drain and t.next is State.draining:
                self._act(rep, "drain", self._drain(rep))
            elif action is Action.cordon_node and not self._node(rep.spec.node).cordoned:
                # Cordons are started by `_cordon`, which marks the node first; an event
                # that reaches this row otherwise (none today) still cordons the node.
                self._spawn(
                    self._cordon(rep.spec.node, (rep.reason,), ticket=True, event=Event.cordon)
                )
        if t.next is State.ready:
            self._reassert(rep)
        self._publish()

    def _reassert(self, rep: _Replica) -> None:
        """Back to ready on one recovery edge; causes still present report again."""
        if rep.storm.state is StormState.storm:
            self._fire(rep, Event.storm, "preemption storm still on")
        elif rep.over_waiting:
            self._fire(rep, Event.not_ready, "queue still over the threshold")
        elif rep.deep_reported:
            self._fire(rep, Event.deep_probe_failed_n, "deep probes still failing")

    def _record(self, rep: _Replica, event: str, before: State, after: State, why: str) -> None:
        now = clock.monotonic()
        self._history.append(
            TransitionRecord(
                now, clock.wall(), rep.spec.replica_id, event, before.value, after.value, why
            )
        )
        if before is not after:
            level = logging.INFO if after in (State.ready, State.starting) else logging.WARNING
            log.log(level, "replica %s: %s -> %s (%s)", rep.spec.replica_id, before, after, why)

    def _act(self, rep: _Replica, kind: str, coro: Coroutine[Any, Any, None]) -> None:
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

    async def _drain(self, rep: _Replica) -> None:
        rid = rep.spec.replica_id
        deadline = clock.monotonic() + self.config.drain_timeout_s
        left = await self.signals.wait_idle(rid, deadline)
        rep.action = None  # the restart that follows is the next action
        self._fire(rep, Event.drained, f"{left} requests left")

    async def _restart(self, rep: _Replica, reason: str, failure: bool) -> None:
        spec = rep.spec
        rep.generation += 1
        rep.restarts += 1
        if self.metrics is not None:
            self.metrics.restarts.labels(spec.node, _reason_label(reason)).inc()
        if failure:
            await self.ledger.record(
                RestartRecord(spec.node, spec.replica_id, reason, at_wall=clock.wall())
            )
        try:
            await self.actuator.restart(spec.ref(rep.model), reason)
        except Exception as exc:  # the replica is back to `starting`; the allowance rules
            log.error("restart of %s failed: %r", spec.replica_id, exc)
        self._reset(rep)
        rep.action = None
        rep.verify_with_deep_probe = failure and self.actuator.name == "none"
        self._fire(rep, Event.restarted, reason)
        if failure:
            await self._maybe_cordon(spec.node)

    async def _maybe_cordon(self, node: str) -> None:
        cfg = self.config
        now_wall = clock.wall()
        recent = await self.ledger.restarts(node, now_wall - cfg.restart_window_s)
        times = [r.at_wall for r in recent]
        if self._node(node).cordoned:
            return
        if should_cordon(times, now_wall, cfg.restart_limit, cfg.restart_window_s):
            why = f"{len(times)} restarts within {cfg.restart_window_s:g} s"
            await self._cordon(node, (why,), ticket=True, event=Event.cordon)

    async def _cordon(
        self, node: str, reasons: tuple[str, ...], ticket: bool, event: Event
    ) -> None:
        n = self._node(node)
        if n.cordoned:
            return
        cfg = self.config
        n.cordoned = True  # first, so that concurrent signals do not cordon twice
        n.since_wall = clock.wall()
        # Routing first: the replicas leave it before any I/O below.
        for rep in self._on_node(node):
            self._fire(rep, event, "; ".join(reasons))
        self._publish()
        recent = await self.ledger.restarts(node, n.since_wall - cfg.restart_window_s)
        gpu = {"gpu_fatal": "; ".join(n.gpu.reasons)} if n.gpu.fatal else {}
        evidence = Evidence(
            node=node,
            reasons=reasons,
            restarts=tuple((r.at_wall, r.replica_id, r.reason) for r in recent),
            extra=gpu,
        )
        n.evidence = evidence
        if self.metrics is not None:
            self.metrics.node_cordoned.labels(node).set(1)
        await self.ledger.set_cordoned(node, True, evidence)
        log.warning("node %s cordoned: %s", node, "; ".join(reasons))
        try:
            await self.actuator.cordon(node, evidence)
        except Exception as exc:
            log.error("actuator could not cordon node %s: %r", node, exc)
        if ticket:
            await self._hardware_ticket(evidence)
        self._publish()

    async def _hardware_ticket(self, evidence: Evidence) -> None:
        body = {
            "node": evidence.node,
            "reasons": list(evidence.reasons),
            "restarts": [
                {"at_wall": t, "replica": replica, "reason": why}
                for t, replica, why in evidence.restarts
            ],
            "extra": evidence.extra,
            "at_wall": clock.wall(),
        }
        log.error("HARDWARE TICKET node=%s %s", evidence.node, orjson.dumps(body).decode())
        if self.metrics is not None:
            self.metrics.hardware_tickets.labels(evidence.node).inc()
        url = self.config.hardware_ticket_webhook_url
        if url is None:
            return
        try:
            async with self.session.post(
                url,
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=self.config.webhook_timeout_s),
            ) as resp:
                if resp.status >= 300:
                    log.error("hardware ticket webhook answered %d", resp.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.error("hardware ticket webhook failed: %r", exc)

    # ---------------------------------------------------------------- publishing

    def _rescore(self) -> None:
        reps = list(self._replicas.values())
        observed = {r.spec.replica_id: self.signals.observed(r.spec.replica_id) for r in reps}
        probe_median = _median(r.deep_latency_s for r in reps)
        ttft_median = _median(o.ttft_p50_s for o in observed.values())
        itl_median = _median(o.itl_p50_s for o in observed.values())
        for rep in reps:
            seen = observed[rep.spec.replica_id]
            load = rep.load
            rep.breakdown = self._score.score(
                ScoreInputs(
                    deep_probe_success_ratio=_ratio(rep.deep_results),
                    deep_probe_latency_s=rep.deep_latency_s,
                    fleet_median_deep_probe_latency_s=probe_median,
                    kv_usage=load.kv_usage if load else None,
                    waiting=load.waiting if load else None,
                    preemption_rate_per_s=rep.storm.last_rate_per_s,
                    ttft_s=seen.ttft_p50_s,
                    fleet_median_ttft_s=ttft_median,
                    itl_s=seen.itl_p50_s,
                    fleet_median_itl_s=itl_median,
                    error_rate=seen.error_rate,
                    hardware_fault=self._node(rep.spec.node).gpu.fatal,
                )
            )

    def _view(self, rep: _Replica) -> ReplicaView:
        node = self._node(rep.spec.node)
        routable = (
            health.routable(rep.state)
            and rep.liveness_failures == 0
            and not rep.held
            and not node.cordoned
        )
        reason = rep.reason
        if rep.held:
            reason = "held out of routing by the operator"
        elif rep.liveness_failures and rep.state in _PROBED_STATES:
            reason = f"liveness failed ({rep.liveness_error}), {rep.liveness_failures} in a row"
        total = rep.breakdown.total if rep.breakdown else 1.0
        load = rep.load
        waiting = load.waiting if load is not None else None
        saturated = waiting is not None and waiting > self.config.ready_waiting_threshold
        return ReplicaView(
            replica_id=rep.spec.replica_id,
            url=rep.spec.url,
            model=rep.model or rep.spec.model,
            node=rep.spec.node,
            routable=routable,
            state=rep.state.value,
            reason=reason,
            score=max(total * health.ROUTING_WEIGHT[rep.state], 1e-6),
            load=load,
            saturated=saturated,
            saturation_reason=f"{waiting:g} waiting in the engine" if saturated else "",
            held=rep.held,
        )

    def _publish(self) -> None:
        views = {rid: self._view(rep) for rid, rep in self._replicas.items()}
        if views == self._snapshot.replicas:
            return
        self._snapshot = FleetSnapshot(replicas=views, taken_at=clock.monotonic())
        if self.metrics is not None:
            self._export(views)
        for listener in self._listeners:
            listener(self._snapshot)

    def _export(self, views: dict[str, ReplicaView]) -> None:
        m = self.metrics
        assert m is not None
        for rid, view in views.items():
            rep = self._replicas[rid]
            for s in State:
                m.replica_state.labels(rid, view.node, s.value).set(1 if rep.state is s else 0)
            m.replica_ready.labels(rid).set(1 if view.routable else 0)
            if rep.breakdown is not None:
                m.replica_score.labels(rid).set(rep.breakdown.total)
                for part, value in rep.breakdown.factors().items():
                    m.replica_score_part.labels(rid, part).set(value)

    # ---------------------------------------------------------------- helpers

    def _new_replica(self, spec: ReplicaSpec) -> _Replica:
        cfg = self.config
        return _Replica(
            spec=spec,
            started_at=clock.monotonic(),
            watchdog=ProgressWatchdog(cfg.watchdog_window_s),
            storm=self._new_storm(),
            deep_results=deque(maxlen=cfg.deep_probe_window),
            model=spec.model,
        )

    def _new_storm(self) -> StormDetector:
        cfg = self.config
        return StormDetector(cfg.storm_rate_threshold_per_s, cfg.storm_sustain_s, cfg.storm_clear_s)

    def _reset(self, rep: _Replica) -> None:
        """A restarted replica starts from nothing: no evidence carries over."""
        cfg = self.config
        rep.started_at = clock.monotonic()
        rep.watchdog = ProgressWatchdog(cfg.watchdog_window_s)
        rep.storm = self._new_storm()
        rep.deep_results.clear()
        rep.deep_streak, rep.deep_reported, rep.deep_latency_s = 0, False, None
        rep.liveness_failures, rep.liveness_error = 0, ""
        rep.load, rep.over_waiting, rep.breakdown = None, False, None

    def _resolve_adapter(self, engine: str, text: str) -> Adapter | None:
        detected = detect_engine(text)
        if engine in ("auto", "vllm"):
            if engine == "vllm" and detected not in (EngineKind.VLLM, EngineKind.VLLM_LEGACY):
                return adapter_for(EngineKind.VLLM)
            return adapter_for(detected) if detected is not None else None
        return adapter_for(engine)

    def _node(self, name: str) -> _Node:
        node = self._nodes.get(name)
        if node is None:
            node = self._nodes[name] = _Node(name)
        return node

    def _on_node(self, node: str) -> list[_Replica]:
        return [r for r in self._replicas.values() if r.spec.node == node]

    def _spawn(self, coro: Coroutine[Any, Any, None], keep: bool = True) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        if keep:
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_crash)
        return task


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("fleet monitor task failed", exc_info=task.exception())


def _ratio(results: deque[bool]) -> float | None:
    return sum(results) / len(results) if results else None


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _reason_label(reason: str) -> str:
    """A bounded metric label: the transition reason without its free-text detail."""
    return reason.split(":", 1)[0][:60]


def _load_dict(load: EngineLoad | None) -> dict[str, float | None] | None:
    if load is None:
        return None
    return {
        "running": load.running,
        "waiting": load.waiting,
        "kv_usage": load.kv_usage,
        "preemptions_total": load.preemptions_total,
        "generation_tokens_total": load.generation_tokens_total,
        "prompt_tokens_total": load.prompt_tokens_total,
        "kv_capacity_tokens": load.kv_capacity_tokens,
    }


def _spec_from(endpoint: Endpoint, model: str, engine: str) -> ReplicaSpec:
    # Without a node name (DNS discovery) each address is its own failure domain: pod IPs
    # change on restart, so restarts do not add up to a cordon there.
    node = endpoint.node or f"unknown:{endpoint.address}"
    return ReplicaSpec(
        endpoint.replica_id,
        endpoint.url,
        model,
        node,
        engine,
        pod=endpoint.pod,
        namespace=endpoint.namespace,
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
